#!/usr/bin/env python3
"""Regenerates the torchvision transform fixtures in ops/tests/fixtures/transforms.

The fixtures pin legion-rs's image pipeline (JPEG/PNG decode, crop, antialiased bilinear resize,
horizontal flip) to torchvision's. Into --out it writes:

- coffee.jpg: scikit-image's `data.coffee()` (a 400x600 photograph) saved by PIL as a baseline
  JPEG, quality 90, 4:2:0 chroma subsampling (PIL's default);
- chelsea.png: scikit-image's `data.chelsea()` (300x451) saved as PNG;
- one RGB PNG per case: what torchvision makes of the source, decoded by
  `torchvision.io.decode_image(path, mode=ImageReadMode.RGB)` (so the expected output includes
  torchvision's JPEG decode), then either
  `resized_crop(top, left, height, width, size, BILINEAR, antialias=True)` and
  `horizontal_flip` when the case flips, or `resize([S], BILINEAR, antialias=True)` (shorter
  side to S) and `center_crop(size)`, all on the uint8 tensor;
- cases.json: `{"torch", "torchvision", "pillow", "scikit_image", "cases": [...]}`, each case
  `{"name", "source", "kind": "resized_crop", "top", "left", "height", "width", "flip", "size",
  "expected"}` or `{"name", "source", "kind": "resize_center_crop", "resize", "size",
  "expected"}`, with size as [height, width];
- README.md: what the folder holds and the versions that made it.

    /tmp/torchenv/bin/pip install torch torchvision scikit-image
    /tmp/torchenv/bin/python integration/torchvision_transforms.py \
        --out ops/tests/fixtures/transforms
"""

import argparse
import json
import os

import numpy as np
import PIL
import skimage
import skimage.data
import torch
import torchvision
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

# Offsets and sizes are deliberately odd so that source pixel grids and output grids do not line
# up: that is where resampling implementations disagree. Outputs other than the 224x224 eval
# crops are small because a photographic PNG costs about 1.7 bytes a pixel and the fixtures are
# committed; any output size exercises the same resampling.
CASES = [
    # coffee.jpg is 400x600 (height x width).
    dict(name="coffee_down", source="coffee.jpg", kind="resized_crop",
         top=21, left=37, height=349, width=501, flip=False, size=[117, 117]),
    dict(name="coffee_down_flip", source="coffee.jpg", kind="resized_crop",
         top=21, left=37, height=349, width=501, flip=True, size=[117, 117]),
    dict(name="coffee_up_flip", source="coffee.jpg", kind="resized_crop",
         top=143, left=287, height=60, width=41, flip=True, size=[224, 224]),
    dict(name="coffee_rect", source="coffee.jpg", kind="resized_crop",
         top=51, left=97, height=301, width=403, flip=False, size=[120, 150]),
    # Height upscaled, width downscaled: the two passes of a separable resize differ in kind.
    dict(name="coffee_mixed", source="coffee.jpg", kind="resized_crop",
         top=133, left=59, height=97, width=411, flip=False, size=[150, 96]),
    dict(name="coffee_whole", source="coffee.jpg", kind="resized_crop",
         top=0, left=0, height=400, width=600, flip=False, size=[64, 64]),
    dict(name="coffee_eval", source="coffee.jpg", kind="resize_center_crop",
         resize=256, size=[224, 224]),
    dict(name="coffee_eval_small", source="coffee.jpg", kind="resize_center_crop",
         resize=73, size=[64, 64]),
    # chelsea.png is 300x451: a lossless source, so only the resampling is under test.
    dict(name="chelsea_down_flip", source="chelsea.png", kind="resized_crop",
         top=17, left=59, height=263, width=331, flip=True, size=[117, 117]),
    dict(name="chelsea_eval", source="chelsea.png", kind="resize_center_crop",
         resize=256, size=[224, 224]),
]


def write_sources(out):
    Image.fromarray(skimage.data.coffee()).save(
        os.path.join(out, "coffee.jpg"), quality=90, progressive=False)
    Image.fromarray(skimage.data.chelsea()).save(os.path.join(out, "chelsea.png"), optimize=True)


def apply(case, img):
    if case["kind"] == "resized_crop":
        img = F.resized_crop(img, case["top"], case["left"], case["height"], case["width"],
                             size=case["size"], interpolation=InterpolationMode.BILINEAR,
                             antialias=True)
        return F.horizontal_flip(img) if case["flip"] else img
    img = F.resize(img, [case["resize"]], interpolation=InterpolationMode.BILINEAR,
                   antialias=True)
    return F.center_crop(img, case["size"])


def write_readme(out, versions):
    text = """# torchvision transform fixtures

`coffee.jpg` (baseline JPEG, quality 90, 4:2:0) and `chelsea.png` are scikit-image's
`data.coffee()` and `data.chelsea()`. Every other PNG is torchvision's uint8 output for one case
of `cases.json`: decode_image (RGB), then resized_crop (+ horizontal_flip) or resize (shorter
side) + center_crop, bilinear with antialias=True.

Produced by `integration/torchvision_transforms.py --out ops/tests/fixtures/transforms` with
torch {torch}, torchvision {torchvision}, Pillow {pillow} and scikit-image {scikit_image}.
Regenerate them with it; do not edit them by hand.
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text.format(**versions))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="fixture folder (created if missing)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    versions = dict(torch=torch.__version__, torchvision=torchvision.__version__,
                    pillow=PIL.__version__, scikit_image=skimage.__version__)
    print(" ".join(f"{k} {v}" for k, v in versions.items()))

    write_sources(args.out)
    cases = []
    for case in CASES:
        img = decode_image(os.path.join(args.out, case["source"]), mode=ImageReadMode.RGB)
        result = apply(case, img)
        assert result.dtype == torch.uint8 and list(result.shape[1:]) == case["size"]
        case = dict(case, expected=case["name"] + ".png")
        Image.fromarray(np.ascontiguousarray(result.permute(1, 2, 0).numpy())).save(
            os.path.join(args.out, case["expected"]), optimize=True)
        cases.append(case)
        print(f"{case['name']}: {case['expected']} {case['size'][0]}x{case['size'][1]}")

    # One case a line, so that a change to the cases reads as a small diff.
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in versions.items())
    body = ",\n  ".join(json.dumps(c) for c in cases)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        f.write(f'{{{head},\n "cases": [\n  {body}\n ]}}\n')
    write_readme(args.out, versions)


if __name__ == "__main__":
    main()
