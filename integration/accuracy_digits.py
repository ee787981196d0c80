#!/usr/bin/env python3
"""Held-out accuracy on a real dataset, legion-rs beside PyTorch with the same model, recipe and
steps: scikit-learn's handwritten digits (1,797 8x8 scans, shipped in the package).

The digits are written as PNG files in class folders, split 80/20 per class with a fixed seed
(`train/` and `val/`). Each framework then trains LeNet-5 (legion-rs's zoo model; the same layers
in torch) at 28x28 for --epochs passes with SGD (momentum 0.9, weight decay 5e-4, a cosine
schedule stepped every batch) and reports the top-1 accuracy on `val/` through the evaluation
recipe (shorter side to 32, centre crop 28), over --seeds seeds each:

- legion-rs on one device and on 4 devices under optcnn (`legion-rs train ... --val-data`);
- PyTorch with torchvision's transforms.v2 on the same files.

Both run with torchvision's training recipe (RandomResizedCrop(28) and a horizontal flip) and
without it (the whole image resized), to show what the augmentation changes. PyTorch starts
from its own initialisation, or with --same-init from the weights legion-rs initialises with the
same seed (`legion-rs train --steps 0 --save`), which leaves only the random draws apart.

    /tmp/torchenv/bin/python integration/accuracy_digits.py --legion target/release/legion-rs

--json prints one JSON object; otherwise a table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import safetensors.numpy
import torch
import torchvision
from PIL import Image
from sklearn.datasets import load_digits
from torch import nn
from torchvision.transforms import v2

# ImageNet's grey statistics: what legion-rs normalises a one-channel folder with.
GREY_MEAN, GREY_STD = 0.449, 0.226


def write_folder(root):
    digits = load_digits()
    rng = np.random.default_rng(0)
    for label in range(10):
        indices = np.flatnonzero(digits.target == label)
        rng.shuffle(indices)
        held = len(indices) // 5
        for split, chosen in (("val", indices[:held]), ("train", indices[held:])):
            folder = os.path.join(root, split, f"digit_{label}")
            os.makedirs(folder, exist_ok=True)
            for i in chosen:
                pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
                Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{i:04d}.png"))


def legion_run(binary, root, args, seed, devices, augment):
    command = [
        binary, "train", "--model", "lenet5", "--image-size", "28", "--classes", "10",
        "--batch", str(args.batch), "--epochs", str(args.epochs), "--lr", str(args.lr),
        "--lr-schedule", "cosine", "--seed", str(seed), "--device", "cpu", "--json",
        "--data", "folder:" + os.path.join(root, "train"),
        "--val-data", "folder:" + os.path.join(root, "val"),
    ]
    if devices > 1:
        command += ["--devices", str(devices), "--strategy", "optcnn"]
    if not augment:
        command += ["--crop", "whole", "--no-flip"]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)}:\n{out.stderr}")
    summary = [json.loads(l) for l in out.stdout.splitlines() if '"summary"' in l][-1]
    return summary["validation"]["top1"]


class LeNet5(nn.Module):
    """legion-rs's zoo LeNet-5: ReLU, max pooling, padding 2 on conv1."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(
            nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def legion_init(binary, root, seed):
    """legion-rs's seeded initial weights of LeNet-5, in its parameters' order."""
    path = os.path.join(root, f"init-{seed}.safetensors")
    command = [binary, "train", "--model", "lenet5", "--image-size", "28", "--classes", "10",
               "--seed", str(seed), "--steps", "0", "--save", path]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)}:\n{out.stderr}")
    return safetensors.numpy.load_file(path)


# legion-rs's LeNet-5 layers with weights, in the order of the torch model's parameters.
LEGION_LAYERS = ["conv1", "conv2", "fc3", "fc4", "fc5"]


def load_init(model, tensors):
    """Copies legion-rs's weights into the torch model (the same shapes, layer by layer)."""
    ours = [tensors[f"{layer}.{kind}"] for layer in LEGION_LAYERS for kind in ("weight", "bias")]
    with torch.no_grad():
        for p, t in zip(model.parameters(), ours, strict=True):
            p.copy_(torch.from_numpy(np.ascontiguousarray(t)))


def torch_run(root, args, seed, augment, init=None):
    torch.manual_seed(seed)
    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([GREY_MEAN], [GREY_STD])]
    grey = v2.Grayscale(1)
    if augment:
        train_tf = v2.Compose([grey, v2.RandomResizedCrop(28, antialias=True),
                               v2.RandomHorizontalFlip(), *tail])
    else:
        train_tf = v2.Compose([grey, v2.Resize((28, 28), antialias=True), *tail])
    eval_tf = v2.Compose([grey, v2.Resize(32, antialias=True), v2.CenterCrop(28), *tail])
    train = torchvision.datasets.ImageFolder(os.path.join(root, "train"), train_tf)
    val = torchvision.datasets.ImageFolder(os.path.join(root, "val"), eval_tf)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True)
    model = LeNet5()
    if init is not None:
        load_init(model, init)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    steps = args.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(args.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            schedule.step()
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(val, batch_size=256):
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return correct / total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--legion", default="target/release/legion-rs")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--same-init", action="store_true",
                        help="PyTorch starts from legion-rs's initial weights of the same seed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        write_folder(root)
        rows = {}
        for augment in (True, False):
            recipe = "augmented" if augment else "plain"
            runs = {
                f"legion-rs 1 device, {recipe}":
                    [legion_run(args.legion, root, args, s, 1, augment) for s in range(args.seeds)],
                f"legion-rs 4 devices optcnn, {recipe}":
                    [legion_run(args.legion, root, args, s, 4, augment) for s in range(args.seeds)],
                f"PyTorch {torch.__version__}, {recipe}":
                    [torch_run(root, args, s, augment,
                               legion_init(args.legion, root, s) if args.same_init else None)
                     for s in range(args.seeds)],
            }
            rows.update(runs)
    report = {name: {"top1": accs, "mean": statistics.mean(accs), "std": statistics.stdev(accs)}
              for name, accs in rows.items()}
    report["settings"] = vars(args)
    if args.json:
        print(json.dumps(report))
        return
    for name, r in report.items():
        if name != "settings":
            print(f"{name:42s} top-1 {100 * r['mean']:.2f} ± {100 * r['std']:.2f} %  "
                  f"({', '.join(f'{100 * a:.1f}' for a in r['top1'])})")


if __name__ == "__main__":
    main()
