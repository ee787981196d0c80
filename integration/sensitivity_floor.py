#!/usr/bin/env python3
"""How far a model carries a rounding-sized difference in its start: PyTorch's side of the
"floor" column of `--compare`.

Trains torchvision's model twice on one seeded batch (every step the same batch, as `--compare`
trains), from the same weights and from those weights moved by one f32 unit in the last place
(up or down at random), with torch.optim.SGD at legion-rs's defaults (lr 0.03, momentum 0.9,
weight decay 5e-4), in float64 and in float32, and prints the largest difference of any weight
or momentum value between the two runs relative to that tensor's largest magnitude (the measure
`--compare` reports), and each run's losses. In float64 no rounding of the arithmetic can account
for the difference: what grows is the model's own sensitivity to its start.

    python3 integration/sensitivity_floor.py --model inception_v3 --image-size 75 --batch 8 --steps 6
"""

import argparse
import json

import torch
import torchvision


def build(name: str, classes: int) -> torch.nn.Module:
    if name == "inception_v3":
        return torchvision.models.inception_v3(
            weights=None, aux_logits=False, init_weights=True, num_classes=classes
        )
    return getattr(torchvision.models, name)(weights=None, num_classes=classes)


def perturbed(module: torch.nn.Module, seed: int) -> None:
    """Moves every nonzero weight by one f32 unit in the last place, up or down."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            ulp = torch.finfo(torch.float32).eps * 2.0 ** torch.floor(torch.log2(p.abs()))
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
            p.add_(torch.where(p == 0, torch.zeros_like(p), sign * ulp.to(p.dtype)))


def train(module, images, labels, steps):
    opt = torch.optim.SGD(module.parameters(), lr=0.03, momentum=0.9, weight_decay=5e-4)
    losses = []
    module.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(images), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = [p.detach().clone() for p in module.parameters()]
    state += [opt.state[p]["momentum_buffer"].clone() for p in module.parameters()]
    return state, losses


def max_rel_diff(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        scale = max(y.abs().max().item(), 1e-12)
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="inception_v3")
    ap.add_argument("--image-size", type=int, default=75)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    base = build(a.model, a.classes)
    images = torch.randn(a.batch, 3, a.image_size, a.image_size)
    labels = torch.randint(0, a.classes, (a.batch,))
    results = {}
    for dtype in (torch.float64, torch.float32):
        runs = []
        for moved in (False, True):
            module = build(a.model, a.classes)
            module.load_state_dict(base.state_dict())
            module = module.to(dtype)
            if moved:
                perturbed(module, a.seed)
            # the same dropout masks in both runs
            torch.manual_seed(a.seed + 1)
            runs.append(train(module, images.to(dtype), labels, a.steps))
        (s0, l0), (s1, l1) = runs
        results[str(dtype).removeprefix("torch.")] = {
            "max_rel_diff": max_rel_diff(s1, s0),
            "losses": l0,
            "losses_moved": l1,
        }
    if a.json:
        print(json.dumps({"model": a.model, "image_size": a.image_size, "batch": a.batch,
                          "steps": a.steps, **results}))
        return
    print(f"{a.model} {a.image_size}x{a.image_size} batch {a.batch}, {a.steps} SGD steps on one batch;")
    print("the same start against one moved by one f32 ulp:")
    for dtype, r in results.items():
        print(f"  {dtype}: max rel diff {r['max_rel_diff']:.1e}")
        print("    losses       " + " ".join(f"{v:.4f}" for v in r["losses"]))
        print("    losses moved " + " ".join(f"{v:.4f}" for v in r["losses_moved"]))


if __name__ == "__main__":
    main()
