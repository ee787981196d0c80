#!/usr/bin/env python3
"""Writes an image-folder dataset of photographic JPEGs for the data-loader benchmark.

Every file is a different random crop (area and aspect ratio), scale and horizontal flip of one
of the colour photographs scikit-image ships with its package (no download), resized with PIL
to --size and saved as a baseline JPEG at --quality: real photographic content, so decode cost
and file sizes behave like a real dataset's, and no two files are the same. The layout is the
one the folder loaders (legion-rs's and torchvision's) read:

    DIR/class_0/img_00000.jpg ... DIR/class_{K-1}/img_{N-1}.jpg

Ends with a one-line summary: files, total bytes and mean KB a file.

    /tmp/torchenv/bin/pip install scikit-image
    /tmp/torchenv/bin/python integration/make_jpeg_folder.py --out /tmp/jpeg500
    # ImageNet-like files, 640x480 at quality 96: about 110 KB each
    /tmp/torchenv/bin/python integration/make_jpeg_folder.py --out /tmp/jpeg640 --size 640x480 \
        --quality 96
"""

import argparse
import math
import os
import random

import skimage.data
from PIL import Image

# The colour photographs bundled in scikit-image's wheel (the other `skimage.data` images are
# greyscale, synthetic, or fetched from the network on first use).
PHOTOS = {
    "astronaut": skimage.data.astronaut,
    "coffee": skimage.data.coffee,
    "chelsea": skimage.data.chelsea,
    "rocket": skimage.data.rocket,
    "immunohistochemistry": skimage.data.immunohistochemistry,
    "hubble_deep_field": skimage.data.hubble_deep_field,
    "retina": skimage.data.retina,
    "motorcycle": lambda: skimage.data.stereo_motorcycle()[0],
}


def parse_size(text):
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def random_view(photo, rng, width, height):
    """A crop of 30-100 % of the photo's area, its aspect ratio within a factor 4/3 of the
    output's, flipped half the time, resized to width x height."""
    src_w, src_h = photo.size
    target = width / height
    for _ in range(20):
        area = src_w * src_h * rng.uniform(0.3, 1.0)
        ratio = target * math.exp(rng.uniform(-math.log(4 / 3), math.log(4 / 3)))
        w = round(math.sqrt(area * ratio))
        h = round(math.sqrt(area / ratio))
        if w <= src_w and h <= src_h:
            break
    else:
        # No sample fitted (a photo far from the output's aspect): the largest crop that does.
        w, h = min(src_w, round(src_h * target)), min(src_h, round(src_w / target))
    left = rng.randint(0, src_w - w)
    top = rng.randint(0, src_h - h)
    view = photo.crop((left, top, left + w, top + h)).resize((width, height), Image.BICUBIC)
    return view.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else view


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="dataset folder (created if missing)")
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--per-class", type=int, default=128)
    ap.add_argument("--size", type=parse_size, default=(500, 375), metavar="WxH",
                    help="output width x height (default 500x375, ImageNet's most common size)")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    photos = [Image.fromarray(load()) for load in PHOTOS.values()]
    width, height = args.size
    files = total = 0
    for k in range(args.classes):
        folder = os.path.join(args.out, f"class_{k}")
        os.makedirs(folder, exist_ok=True)
        for i in range(args.per_class):
            path = os.path.join(folder, f"img_{i:05d}.jpg")
            random_view(rng.choice(photos), rng, width, height).save(path, quality=args.quality)
            files += 1
            total += os.path.getsize(path)
    print(f"{files} files, {total} bytes, {total / max(files, 1) / 1024:.1f} KB mean "
          f"({width}x{height}, quality {args.quality}) in {args.out}")


if __name__ == "__main__":
    main()
