"""Exports torchvision's CNNs as graph-only ONNX files: AlexNet, VGG-16, Inception-v3, ResNet-50
and -18, ResNeXt-50 32x4d, MobileNetV2, EfficientNet-B0, DenseNet-121, SqueezeNet 1.0, GoogLeNet
and RegNet-Y-400MF.

The files hold the graph and every weight's shape (as graph inputs, `export_params=False`) but no
weight values, so they stay a few kilobytes; `legion-rs` imports them and trains from its own
initialisation. `ops/onnx/tests/torchvision.rs` checks that each imports with the zoo's
parameter count, FLOPs and plan.

    python3 -m venv /tmp/onnxenv && /tmp/onnxenv/bin/pip install torch torchvision onnx
    /tmp/onnxenv/bin/python integration/onnx/export_torchvision.py

Made with torch 2.15.0, torchvision 0.29.2 and onnx 1.23.2 (TorchScript exporter, opset 17).

How the export is set up, and why:
- The models are in eval mode (batch norm exported as an inference node, not fused into the
  convolution: TrainingMode.PRESERVE skips the eval-mode peephole that folds it), except their
  Dropout modules, which are left in training mode so that the exporter keeps them as Dropout
  nodes: an eval-mode export drops them, and the zoo's models train with them.
- Every parameter and buffer is filled with distinct random values first: the exporter merges
  parameters with equal values (a fresh batch norm's weights are all ones) into one input read
  through Identity nodes, which would hide the model's own weight names.
- Inception-v3 and GoogLeNet without their auxiliary classifiers, as the zoo has Inception-v3.
"""

import os

import torch
import torchvision

OUT = os.path.dirname(os.path.abspath(__file__))
OPSET = 17

MODELS = {
    "alexnet": (lambda: torchvision.models.alexnet(weights=None), 224),
    "vgg16": (lambda: torchvision.models.vgg16(weights=None), 224),
    "inception_v3": (
        lambda: torchvision.models.inception_v3(
            weights=None, aux_logits=False, init_weights=False
        ),
        299,
    ),
    "resnet50": (lambda: torchvision.models.resnet50(weights=None), 224),
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), 224),
    "resnext50_32x4d": (lambda: torchvision.models.resnext50_32x4d(weights=None), 224),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(weights=None), 224),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(weights=None), 224),
    "densenet121": (lambda: torchvision.models.densenet121(weights=None), 224),
    "squeezenet1_0": (lambda: torchvision.models.squeezenet1_0(weights=None), 224),
    "googlenet": (
        lambda: torchvision.models.googlenet(
            weights=None, aux_logits=False, init_weights=False
        ),
        224,
    ),
    "regnet_y_400mf": (lambda: torchvision.models.regnet_y_400mf(weights=None), 224),
}


def export(name, make, size):
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.uniform_(0.5, 1.5)
    model.eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.train()
    path = os.path.join(OUT, f"{name}.onnx")
    torch.onnx.export(
        model,
        (torch.zeros(1, 3, size, size),),
        path,
        dynamo=False,
        export_params=False,
        input_names=["data"],
        output_names=["logits"],
        opset_version=OPSET,
        training=torch.onnx.TrainingMode.PRESERVE,
        dynamic_axes={"data": {0: "batch"}, "logits": {0: "batch"}},
    )
    print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    import sys

    for name, (make, size) in MODELS.items():
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            export(name, make, size)
