#!/usr/bin/env python3
"""The torchvision peer of the data-loader benchmark: its best CPU pipeline, decoding and
augmenting an image folder into normalised float32 batches, in images a second.

The pipeline is the one torchvision recommends for training on the CPU: a Dataset over the
folder's files (class subfolders in sorted order), each file read and decoded to uint8 by
`torchvision.io.decode_jpeg(torchvision.io.read_file(path))`, then transforms.v2
`RandomResizedCrop(size, antialias=True)`, `RandomHorizontalFlip()`,
`ToDtype(float32, scale=True)` and `Normalize` (ImageNet's mean and std); with --eval,
`Resize(size * 256 / 224)` and `CenterCrop(size)` instead of the two random transforms. A
`DataLoader(batch, shuffle=True, num_workers, persistent_workers, drop_last=True)` batches it,
each process on one intra-op thread so that workers, not threads, share the cores.

The first epoch is a warm-up (worker start, page cache); the rate is over the later epochs, also
per core (the cores this process may run on). With --workers-sweep it measures 0, 1, ..., cores
workers and reports the best, the figure the benchmark compares against.

    /tmp/torchenv/bin/python integration/make_jpeg_folder.py --out /tmp/jpeg500
    /tmp/torchenv/bin/python integration/loader_peer.py --data /tmp/jpeg500 --workers-sweep --json
    /tmp/torchenv/bin/python integration/loader_peer.py --data /tmp/jpeg500 --eval --json

--json prints one JSON object on stdout (the sweep's progress goes to stderr); otherwise one line
of text.
"""

import argparse
import json
import os
import sys
import time

import torch
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.io import decode_jpeg, read_file
from torchvision.transforms import v2

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


class ImageFolder(Dataset):
    """(path, label) for every JPEG under root/<class>/, classes and files in sorted order."""

    def __init__(self, root, transform):
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.items = [
            (os.path.join(root, name, f), label)
            for label, name in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(root, name)))
            if f.lower().endswith((".jpg", ".jpeg"))
        ]
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        path, label = self.items[index]
        return self.transform(decode_jpeg(read_file(path))), label


def pipeline(size, evaluate):
    if evaluate:
        geometry = [v2.Resize(size * 256 // 224, antialias=True), v2.CenterCrop(size)]
    else:
        geometry = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    return v2.Compose(geometry + [v2.ToDtype(torch.float32, scale=True),
                                  v2.Normalize(mean=MEAN, std=STD)])


def one_thread(_worker_id=None):
    """Each process (the workers, and the main one when it loads in-process) on one intra-op
    thread: per-image transforms are too small for intra-op parallelism to pay, and waking
    threads for them costs more than the work (on a 2-core VM, two threads made the in-process
    pipeline twenty times slower)."""
    torch.set_num_threads(1)


def measure(dataset, batch, workers, epochs):
    """Images a second of each epoch after the first, and over all of them."""
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                        persistent_workers=workers > 0, drop_last=True,
                        worker_init_fn=one_thread if workers else None)
    per_epoch, images, seconds = [], 0, 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        count = sum(x.shape[0] for x, _ in loader)
        elapsed = time.perf_counter() - start
        if epoch > 0:
            per_epoch.append(count / elapsed)
            images += count
            seconds += elapsed
    return images / seconds, per_epoch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="image folder: DIR/<class>/*.jpg")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--workers-sweep", action="store_true",
                    help="measure 0, 1, ..., cores workers and report the best")
    ap.add_argument("--epochs", type=int, default=3, help="epochs, the first one untimed")
    ap.add_argument("--size", type=int, default=224, help="output side in pixels")
    ap.add_argument("--eval", action="store_true", help="resize and centre crop, no augmentation")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    if args.epochs < 2:
        ap.error("--epochs must be at least 2: the first one is a warm-up")

    dataset = ImageFolder(args.data, pipeline(args.size, args.eval))
    if len(dataset) < args.batch:
        ap.error(f"{args.data} has {len(dataset)} images, fewer than one batch of {args.batch}")
    cores = len(os.sched_getaffinity(0))
    one_thread()

    sweep = []
    for workers in range(cores + 1) if args.workers_sweep else [args.workers]:
        rate, per_epoch = measure(dataset, args.batch, workers, args.epochs)
        sweep.append(dict(workers=workers, images_per_s=round(rate, 1),
                          epoch_images_per_s=[round(r, 1) for r in per_epoch]))
        if args.workers_sweep:
            print(f"{workers} workers: {rate:.1f} images/s", file=sys.stderr)
    best = max(sweep, key=lambda s: s["images_per_s"])

    result = dict(
        peer="torchvision",
        pipeline="eval" if args.eval else "train",
        data=args.data,
        images=len(dataset),
        batch=args.batch,
        size=args.size,
        timed_epochs=args.epochs - 1,
        cores=cores,
        workers=best["workers"],
        images_per_s=best["images_per_s"],
        images_per_s_per_core=round(best["images_per_s"] / cores, 1),
        epoch_images_per_s=best["epoch_images_per_s"],
        torch=torch.__version__,
        torchvision=torchvision.__version__,
    )
    if args.workers_sweep:
        result["sweep"] = [dict(workers=s["workers"], images_per_s=s["images_per_s"])
                           for s in sweep]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"torchvision {result['pipeline']}: {result['images_per_s']} images/s "
              f"({result['images_per_s_per_core']} a core, {cores} cores), "
              f"{result['workers']} workers, batch {args.batch}, {args.size}px, "
              f"torch {result['torch']}, torchvision {result['torchvision']}")


if __name__ == "__main__":
    main()
