#!/usr/bin/env python3
"""The data-parallel peer a user would pick instead: PyTorch DistributedDataParallel (gloo) on CPUs.

Run under torchrun, one process per rank (`integration/shaped_compare.sh --ddp` starts it in each
shaped host's network namespace):

    python3 -m torch.distributed.run --nnodes H --nproc-per-node R --node-rank I \
        --master-addr ADDR --master-port PORT integration/ddp_peer.py MODEL:IMAGE:BATCH [--steps 4]

BATCH is the global batch, split evenly over the ranks, as legion-rs splits it over its devices.
Each rank trains the torchvision model on synthetic data with SGD (lr 0.01, momentum 0.9, weight
decay 5e-4, as legion-rs trains), DDP all-reducing the gradients in its default 25 MB buckets
overlapped with the backward pass. After --warmup untimed steps, each of --steps steps is timed on
every rank; a step's time is its slowest rank's. With --expect-params (legion-rs's count), a model of
another size is refused: both systems must train the same network. Rank 0 prints one JSON object: the median, least
and greatest step in milliseconds, images per second, the parameters' bytes and what a ring
all-reduce of them sends per rank.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torchvision


def build(name: str, size: int, classes: int) -> torch.nn.Module:
    if name == "alexnet":
        return torchvision.models.alexnet(num_classes=classes)
    if name == "vgg16":
        # legion-rs's VGG-16 feeds its first dense layer the last pooling's output as it is;
        # torchvision's pools it to 7x7 first, which below 224x224 makes another, larger network
        model = torchvision.models.vgg16(num_classes=classes)
        model.avgpool = torch.nn.Identity()
        model.classifier[0] = torch.nn.Linear(512 * (size // 32) ** 2, 4096)
        return model
    if name == "inception_v3":
        return torchvision.models.inception_v3(
            num_classes=classes, aux_logits=False, init_weights=False
        )
    if name == "resnet50":
        return torchvision.models.resnet50(num_classes=classes)
    raise SystemExit(f"unknown model {name}: expected alexnet, vgg16, inception_v3 or resnet50")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", help="MODEL:IMAGE:BATCH, BATCH the global batch")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per rank; 0: this machine's cores over all ranks")
    parser.add_argument("--expect-params", type=int,
                        help="refuse to run a model of another parameter count (legion-rs's)")
    args = parser.parse_args()
    try:
        model_name, size, batch = args.run.split(":")
        size, batch = int(size), int(batch)
    except ValueError:
        raise SystemExit(f"{args.run!r}: expected MODEL:IMAGE:BATCH, e.g. alexnet:224:32")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch % world:
        raise SystemExit(f"global batch {batch} does not split evenly over {world} ranks")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    hosts = world // local
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)

    torch.manual_seed(1)
    model = build(model_name, size, args.classes)
    params = sum(p.numel() for p in model.parameters())
    if args.expect_params is not None and params != args.expect_params:
        raise SystemExit(f"{model_name} at {size}x{size} has {params} parameters here, "
                         f"{args.expect_params} in legion-rs: not the same network")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(batch // world, 3, size, size, generator=generator)
    labels = torch.randint(0, args.classes, (batch // world,), generator=generator)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(images), labels).backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    dist.barrier()
    times = torch.tensor([step() for _ in range(args.steps)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms = [1000.0 * t for t in times.tolist()]
        param_bytes = 4 * params
        median = statistics.median(ms)
        print(json.dumps({
            "system": "pytorch-ddp",
            "backend": "gloo",
            "torch": torch.__version__,
            "model": model_name,
            "image_size": size,
            "batch": batch,
            "hosts": hosts,
            "ranks_per_host": local,
            "threads_per_rank": threads,
            "steps": args.steps,
            "median_ms": median,
            "min_ms": min(ms),
            "max_ms": max(ms),
            "images_per_sec": 1000.0 * batch / median,
            "param_bytes": param_bytes,
            "ring_bytes_per_rank": 2 * (world - 1) * param_bytes // world,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
