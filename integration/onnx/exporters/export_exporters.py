"""Exports one small CNN with each of PyTorch's ONNX exporters, weights included, for the import
tests (`ops/onnx/tests/exporters.rs`):

- `torchscript_preserve.onnx`: `dynamo=False, training=TrainingMode.PRESERVE`, BatchNorm kept;
- `torchscript_folded.onnx`: `dynamo=False` in eval mode, the exporter's default, BatchNorm
  folded into the convolution;
- `dynamo.onnx`: `dynamo=True` (needs onnxscript), weights inside the file;
- `dynamo_external.onnx` with `dynamo_external.onnx.data`: the same, weights in an external data
  file, as the dynamo exporter writes large models;
- `state_dict.safetensors`: the module's `state_dict`, buffers (`num_batches_tracked`) included,
  as a user writes one for `--init`;
- `torchscript_fresh.onnx`: a freshly initialised module, BatchNorm kept, whose equal-valued
  tensors (BatchNorm's ones and zeros) the exporter shares through Identity nodes.

    /tmp/onnxenv/bin/pip install torch torchvision onnx onnxscript safetensors
    /tmp/onnxenv/bin/python integration/onnx/exporters/export_exporters.py

Made with torch 2.15.0, onnx 1.23.2 and onnxscript, opset 17 (TorchScript) and 20 (dynamo).
"""

import os

import torch
from torch import nn

OUT = os.path.dirname(os.path.abspath(__file__))


class Small(nn.Module):
    """conv-bn-relu, a ceil_mode max pool, a depthwise conv-bn-relu6, a mean over H and W, fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = nn.functional.relu6(self.bn2(self.dw(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def main():
    from safetensors.torch import save_file

    path = lambda name: os.path.join(OUT, name)
    names = dict(input_names=["data"], output_names=["logits"])
    torchscript = dict(dynamo=False, opset_version=17, **names)
    preserve = dict(training=torch.onnx.TrainingMode.PRESERVE, **torchscript)
    x = torch.zeros(2, 3, 16, 16)
    torch.manual_seed(0)
    fresh = Small().eval()
    torch.onnx.export(fresh, (x,), path("torchscript_fresh.onnx"), **preserve)
    model = Small()
    with torch.no_grad():
        # distinct values: the exporters merge equal-valued tensors into one
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.uniform_(0.5, 1.5)
    model.eval()
    torch.onnx.export(model, (x,), path("torchscript_preserve.onnx"), **preserve)
    torch.onnx.export(model, (x,), path("torchscript_folded.onnx"), **torchscript)
    torch.onnx.export(model, (x,), path("dynamo.onnx"), dynamo=True, external_data=False)
    torch.onnx.export(model, (x,), path("dynamo_external.onnx"), dynamo=True, external_data=True)
    save_file(model.state_dict(), path("state_dict.safetensors"))
    for name in sorted(os.listdir(OUT)):
        print(f"{name}: {os.path.getsize(path(name))} bytes")


if __name__ == "__main__":
    main()
