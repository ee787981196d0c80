#!/usr/bin/env python3
"""The peer a user would pick instead: PyTorch training the same zoo model on the same GPU.

Prints one JSON object per model and mode: median step milliseconds over the measured steps,
images per second, and the settings. Strict FP32 (TF32 off in cuBLAS and cuDNN, the default of
legion-rs), TF32 with --tf32, both (strict first) with --both; bf16 with --bf16: autocast to
bfloat16 with the model and the batch in channels_last (the fast mixed-precision setting a user
would pick; TF32 allowed for what autocast leaves in fp32, PyTorch's default for convolutions),
the peer of `legion-rs train --precision bf16`; --all runs strict FP32, TF32, then bf16. SGD with momentum 0.9 and weight
decay 5e-4, as legion-rs trains; synthetic data resident on the GPU; cudnn.benchmark on. Models
are built on the GPU (their initialisation is not what is measured).

With --profile FILE, one more step after the measured ones runs under torch.profiler, and FILE
gets its CUDA kernels grouped by name (milliseconds of device time in that step), the peer's side
of legion-rs's one-device `--trace`.

With --layout nchw, bf16 keeps PyTorch's default NCHW memory format (legion-rs's layout): beside
the channels_last run it measures what NHWC gains cuDNN's bf16 kernels on this GPU.

usage: pytorch_peer.py MODEL:IMAGE:BATCH [...] [--tf32 | --bf16 | --both | --all] [--warmup 5]
                       [--steps 15] [--layout channels_last|nchw]
                       [--profile FILE]
"""
import argparse
import json
import statistics
import time

import torch
import torchvision


def build(name: str, classes: int) -> torch.nn.Module:
    if name == "alexnet":
        return torchvision.models.alexnet(num_classes=classes)
    if name == "vgg16":
        return torchvision.models.vgg16(num_classes=classes)
    if name == "inception_v3":
        return torchvision.models.inception_v3(
            num_classes=classes, aux_logits=False, init_weights=False
        )
    if name == "resnet50":
        return torchvision.models.resnet50(num_classes=classes)
    raise SystemExit(f"unknown model {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="MODEL:IMAGE:BATCH")
    parser.add_argument("--tf32", action="store_true")
    parser.add_argument("--both", action="store_true", help="strict FP32, then TF32")
    parser.add_argument("--bf16", action="store_true", help="autocast bf16 + channels_last")
    parser.add_argument("--all", action="store_true", help="strict FP32, TF32, then bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--profile", help="write one profiled step's kernels here")
    parser.add_argument("--layout", choices=["channels_last", "nchw"], default="channels_last",
                        help="bf16's memory format (NCHW: legion-rs's, to measure what NHWC gains)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    if args.all:
        modes = ["fp32", "tf32", "bf16"]
    elif args.both:
        modes = ["fp32", "tf32"]
    else:
        modes = ["bf16" if args.bf16 else "tf32" if args.tf32 else "fp32"]
    for run in args.runs:
        name, image, batch = run.split(":")
        image, batch = int(image), int(batch)
        for precision in modes:
            tf32 = precision != "fp32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            median = measure(name, image, batch, args, device, precision == "bf16")
            print(json.dumps({
                "peer": "pytorch", "torch": torch.__version__, "model": name, "image": image,
                "batch": batch, "tf32": precision == "tf32", "precision": precision,
                "layout": args.layout if precision == "bf16" else "nchw",
                "median_step_ms": median, "images_per_sec": batch / median * 1e3,
            }), flush=True)


def measure(name: str, image: int, batch: int, args, device, bf16: bool = False) -> float:
    with device:
        model = build(name, args.classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, args.classes, (batch,), device=device)
    if bf16 and args.layout == "channels_last":
        # fp32 master weights, bf16 convolutions and products on NHWC tensors
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    if args.profile:
        profile_step(name, image, batch, args.profile, lambda: train_step(model, opt, loss_fn, x, y))
    return statistics.median(times)


def train_step(model, opt, loss_fn, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    opt.step()


def profile_step(name: str, image: int, batch: int, path: str, step) -> None:
    """One step under torch.profiler: its CUDA kernels by name, appended to `path`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
    total = sum(kernels.values())
    tf32 = torch.backends.cudnn.allow_tf32
    with open(path, "a") as out:
        out.write(f"== PyTorch {name} {image} b{batch} {'tf32' if tf32 else 'fp32'}: "
                  f"{total:.2f} ms of kernels in one step\n")
        for kernel, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:30]:
            out.write(f"{ms:9.3f} ms  {kernel[:150]}\n")

if __name__ == "__main__":
    main()
