#!/usr/bin/env python3
"""A training step driven from Python beside the same step from the binary: the same model,
devices, strategy, batch and data, each run in a process of its own, in alternating rounds so
that a slow spell of the machine falls on every variant.

Variants:
- `binary`: `legion-rs train --model M ... --json`, its `step_ms` lines;
- `python`: `legion_rs.train("M", "synthetic:N", ...)`, the step events' seconds;
- `python-numpy`: `legion_rs.train("M", batches, ...)` over a list of numpy batches;
- `python-torch` (with torch and torchvision): torchvision's module of that name, exported by
  `legion_rs` and trained from its weights on the numpy batches.

Each run's step time is the median over its steps but the first (warm-up) and the last (its time
ends with the run); a variant's is the median over the rounds, and its ratio to the binary's the
median of the rounds' ratios.

    maturin build --release -m cluster/python/Cargo.toml --out /tmp/wheels
    /tmp/torchenv/bin/pip install --force-reinstall --no-deps /tmp/wheels/legion_rs-*.whl
    cargo build --release -p legion-cli
    /tmp/torchenv/bin/python integration/python_front.py --model resnet18 --image-size 64 \
        --batch 16 --devices 4 --steps 12 --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = r"""
import json, sys
import numpy as np
import legion_rs
variant, model, size, classes, batch, devices, strategy, steps = sys.argv[1:9]
size, classes, batch, devices, steps = map(int, (size, classes, batch, devices, steps))
seconds = []
def on_event(e):
    if e["event"] == "step":
        seconds.append(e["seconds"])
common = dict(batch=batch, devices=devices, strategy=strategy, device="cpu", progress=on_event)
rng = np.random.default_rng(0)
batches = [(rng.standard_normal((batch, 3, size, size), dtype=np.float32),
            rng.integers(0, classes, batch)) for _ in range(steps)]
if variant == "python":
    legion_rs.train(model, f"synthetic:{batch * steps}", image_size=size, classes=classes,
                    steps=steps, **common)
elif variant == "python-numpy":
    legion_rs.train(model, batches, image_size=size, classes=classes, **common)
else:
    import torch, torchvision
    module = getattr(torchvision.models, model)(num_classes=classes)
    legion_rs.train(module, batches, example_input=torch.zeros(1, 3, size, size), **common)
print(json.dumps(seconds))
"""


def binary_steps(legion, args):
    cmd = [legion, "train", "--model", args.model, "--image-size", str(args.image_size),
           "--classes", str(args.classes), "--batch", str(args.batch), "--devices",
           str(args.devices), "--strategy", args.strategy, "--steps", str(args.steps),
           "--data", f"synthetic:{args.batch * args.steps}", "--device", "cpu", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(line)["step_ms"] / 1e3 for line in out.splitlines() if '"step_ms"' in line]


def python_steps(variant, args):
    cmd = [sys.executable, "-c", RUN, variant, args.model, str(args.image_size),
           str(args.classes), str(args.batch), str(args.devices), args.strategy, str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def step_time(seconds):
    inner = seconds[1:-1] or seconds
    return statistics.median(inner)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--strategy", default="optcnn")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--legion", default=os.path.join(ROOT, "target/release/legion-rs"))
    args = p.parse_args()
    variants = ["binary", "python", "python-numpy"]
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
        variants.append("python-torch")
    except ImportError:
        print("torch or torchvision missing: no python-torch variant", file=sys.stderr)
    rounds = []
    for r in range(args.rounds):
        times = {}
        for v in variants:
            seconds = binary_steps(args.legion, args) if v == "binary" else python_steps(v, args)
            times[v] = step_time(seconds)
            print(f"round {r + 1}: {v} {times[v] * 1e3:.1f} ms", file=sys.stderr)
        rounds.append(times)
    report = {
        "model": args.model, "image_size": args.image_size, "batch": args.batch,
        "devices": args.devices, "strategy": args.strategy, "steps": args.steps,
        "rounds": args.rounds,
        "step_ms": {v: statistics.median(t[v] for t in rounds) * 1e3 for v in variants},
        "ratio_to_binary": {v: statistics.median(t[v] / t["binary"] for t in rounds)
                            for v in variants if v != "binary"},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
