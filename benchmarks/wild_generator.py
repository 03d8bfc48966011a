"""The wild set's generator (``sslkit data wild``): images written per second per core, against the floor of writing
the same files with PIL alone.

    python benchmarks/wild_generator.py [--images 20000] [--canvas 32] [--workers 1] [--photos DIR] [--quick]

Measured one after the other in this process, after the photographs and Fashion-MNIST are read (their start-up,
under two seconds, is printed apart):

* ``render``: :meth:`~sslkit.data.wild.WildScenes.render` alone, in batches of 64, images/s;
* ``sslkit``: :func:`~sslkit.data.wild_files.write_wild` of ``--images`` training images (and 1 test image) into a
  scratch folder: rendering, the image and class-map PNGs, the COCO file and ``dataset.json``, images/s per worker;
* ``plain``: the same images, rendered beforehand, written as the same two PNGs each with PIL into an ImageFolder
  tree: the file-writing floor, images/s.

Prints the three rates, sslkit's per worker, and ``sslkit / plain`` (1.0: the renderer costs nothing beside the
files). ``--quick`` (1,000 images) checks that it runs: its figures are not for the docs.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _plain(rendered: object, folder: Path) -> float:
    """The floor: each image and its class map written as PNGs with PIL, one file each, as sslkit lays them out."""
    from PIL import Image

    images, masks, labels = rendered.images, rendered.masks, rendered.labels  # type: ignore[attr-defined]
    for k in range(10):
        (folder / "train" / str(k)).mkdir(parents=True, exist_ok=True)
    (folder / "maps").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i in range(len(images)):
        for data, path in ((images[i], folder / "train" / str(int(labels[i])) / f"{i:06d}.png"),
                           (masks[i], folder / "maps" / f"{i:06d}.png")):
            out = io.BytesIO()
            Image.fromarray(data).save(out, format="png", compress_level=1)
            path.write_bytes(out.getvalue())
    return len(images) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    from sslkit.data.photos import load_photos
    from sslkit.data.sources import build_source
    from sslkit.data.wild import WildScenes, WildSpec
    from sslkit.data.wild_files import write_wild

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--canvas", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--photos", default=None, help="a photograph folder (default: the mate set, or dead leaves)")
    parser.add_argument("--scratch", default=None, help="where the sets are written (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="1,000 images: checks that it runs")
    args = parser.parse_args(argv)
    n = 1000 if args.quick else args.images
    torch.set_num_threads(1)
    start = time.perf_counter()
    spec = WildSpec(canvas=args.canvas)
    photos = load_photos(args.photos, spec.canvas, spec.zooms)
    train = build_source("fashion_mnist", "train")
    scenes = WildScenes(train.images, train.labels, photos.train, spec, 0, "train", n)  # type: ignore[attr-defined]
    ready = time.perf_counter() - start
    t0 = time.perf_counter()
    parts = [scenes.render(np.arange(s, min(s + 64, n))) for s in range(0, n, 64)]
    render_rate = n / (time.perf_counter() - t0)
    rendered = parts[0]._replace(images=np.concatenate([p.images for p in parts]),
                                 masks=np.concatenate([p.masks for p in parts]),
                                 labels=np.concatenate([p.labels for p in parts]))
    scratch = Path(tempfile.mkdtemp(prefix="wild-bench-", dir=args.scratch))
    try:
        t0 = time.perf_counter()
        write_wild(scratch / "sslkit", spec, 0, {"train": n, "test": 1}, photos, workers=args.workers)
        sslkit_rate = (n + 1) / (time.perf_counter() - t0)
        plain_rate = _plain(rendered, scratch / "plain")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{sys.version.split()[0]}, torch {torch.__version__}, numpy {np.__version__}")
    print(f"{n} images of {spec.canvas} px from {photos.origin}; photographs and Fashion-MNIST read in {ready:.2f} s")
    print("| what | images/s | per worker | ratio to plain |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| render (no files) | {render_rate:,.0f} | {render_rate:,.0f} | {render_rate / plain_rate:.2f} |")
    print(f"| sslkit data wild, {args.workers} worker(s) | {sslkit_rate:,.0f} | {sslkit_rate / args.workers:,.0f} | "
          f"{sslkit_rate / plain_rate:.2f} |")
    print(f"| plain (PIL writes the rendered images) | {plain_rate:,.0f} | {plain_rate:,.0f} | 1.00 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
