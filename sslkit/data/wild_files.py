"""The wild set on disk: written by ``sslkit data wild`` (images in an ImageFolder tree per split or in tar shards,
COCO boxes, ADE20K-layout class maps, ``dataset.json``), read back as the ``wild`` data source, and built once into
the cache when a run names ``data=wild`` without a folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sslkit.data.photos import PhotoSet, load_photos
from sslkit.data.segmentation import ADE_SPLITS, FASHION_CLASSES, FOLDER_META, stored_class_map
from sslkit.data.sources import DataSourceError, TensorImageDataset, build_source, cache_dir, save_arrays
from sslkit.data.wild import WILD_VERSION, Rendered, WildScenes, WildSpec
from sslkit.registry import register_dataset

__all__ = ["CLASS_FOLDERS", "WILD_NAME", "build_wild", "is_wild", "read_wild_split", "wild_cache", "wild_folder",
           "wild_pairs", "write_wild"]

logger = logging.getLogger("sslkit")

#: What ``dataset.json`` calls the set (how a folder is known to be one).
WILD_NAME = "fashion-mnist-wild"
#: The class folders of the ImageFolder tree, in label order (sorted by name, as ImageFolder sorts them).
CLASS_FOLDERS = tuple(f"{k}-{''.join(ch if ch.isalnum() else '-' for ch in name.lower())}"
                      for k, name in enumerate(FASHION_CLASSES))
#: Images rendered (and written) per task: small enough to keep the renderer's arrays in cache.
CHUNK = 64
#: The default numbers of images: every Fashion-MNIST garment once.
DEFAULT_COUNTS = {"train": 60000, "test": 10000}


def _name(i: int, count: int) -> str:
    return f"{i:0{max(6, len(str(count - 1)))}d}"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(pixels: np.ndarray) -> bytes:
    """An 8-bit greyscale ``[H, W]`` or RGB ``[H, W, 3]`` array as a PNG file: IHDR, one IDAT of zlib level 1 over
    the rows unfiltered (filter byte 0), IEND. Written out because PIL's ``save`` took 160 us an image at 32 px
    and this 35 (benchmarks/wild_generator.py); any PNG reader gives back the same pixels (tested with PIL)."""
    h, w = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    if pixels.dtype != np.uint8 or channels not in (1, 3):
        raise ValueError(f"_png writes 8-bit greyscale or RGB arrays, not {pixels.dtype} [{h}, {w}, {channels}]")
    rows = np.zeros((h, w * channels + 1), dtype=np.uint8)
    rows[:, 1:] = pixels.reshape(h, w * channels)
    header = struct.pack(">IIBBBBB", w, h, 8, 0 if channels == 1 else 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
            + _chunk(b"IEND", b""))


# One renderer per process of the pool (set before it forks, read by the workers).
_SCENES: dict[str, WildScenes] = {}


def _render_chunk(task: tuple[str, str, int, int, str]) -> tuple[int, Rendered, list[bytes]]:
    """Render images ``[start, stop)`` of ``split``, write their class maps (and, for the folder layout, their
    images); returns the chunk, and the images' PNG bytes for shards."""
    root, split, start, stop, fmt = task
    scenes = _SCENES[split]
    out = scenes.render(np.arange(start, stop))
    maps = os.path.join(root, "annotations", ADE_SPLITS[split])
    folders = [os.path.join(root, split, c) for c in CLASS_FOLDERS]
    encoded = []
    for j, i in enumerate(range(start, stop)):
        name = f"{_name(i, len(scenes))}.png"
        data = _png(out.images[j])
        if fmt == "folder":
            _write(os.path.join(folders[int(out.labels[j])], name), data)
        else:
            encoded.append(data)
        _write(os.path.join(maps, name), _png(stored_class_map(out.masks[j])))
    return start, out, encoded


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _chunks(root: Path, split: str, count: int, fmt: str, workers: int) -> Iterator[tuple[int, Rendered, list[bytes]]]:
    tasks = [(str(root), split, s, min(s + CHUNK, count), fmt) for s in range(0, count, CHUNK)]
    if workers <= 1:
        yield from map(_render_chunk, tasks)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from pool.imap(_render_chunk, tasks, chunksize=4)


def _coco(split: str, count: int, fmt: str, spec: WildSpec, rows: list[tuple[int, Rendered]]) -> dict[str, Any]:
    """The split's COCO instances file: one image entry per image, one annotation per visible garment (its visible
    pixels' box and count; ``main``: the labelled garment; ``garment``: its Fashion-MNIST index)."""
    images, annotations = [], []
    for start, out in rows:
        for j, objects in enumerate(out.objects):
            i = start + j
            name = f"{_name(i, count)}.png"
            # in shards, the member write_shards names by its position: <9 digits>.png
            where = f"{split}/{CLASS_FOLDERS[int(out.labels[j])]}/{name}" if fmt == "folder" else f"{i:09d}.png"
            images.append({"id": i, "file_name": where, "width": spec.canvas, "height": spec.canvas,
                           "label": int(out.labels[j])})
            for o in objects:
                annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": o.category + 1,
                                    "bbox": list(o.box), "area": o.area, "iscrowd": 0, "main": o.main,
                                    "garment": o.garment})
    return {"info": {"description": f"{WILD_NAME} {split}", "version": str(WILD_VERSION)},
            "images": images, "annotations": annotations,
            "categories": [{"id": k + 1, "name": n, "supercategory": "garment"} for k, n in enumerate(FASHION_CLASSES)]}


def _write_split(root: Path, scenes: WildScenes, split: str, fmt: str, workers: int,
                 progress: Callable[[int], None] | None) -> str:
    """Write one split; returns the SHA-256 of its images' pixels in index order."""
    from sslkit.data.shards import write_shards

    count, digest = len(scenes), hashlib.sha256()
    (root / "annotations" / ADE_SPLITS[split]).mkdir(parents=True, exist_ok=True)
    if fmt == "folder":
        for folder in CLASS_FOLDERS:
            (root / split / folder).mkdir(parents=True, exist_ok=True)
    _SCENES[split] = scenes
    rows: list[tuple[int, Rendered]] = []

    def items() -> Iterator[tuple[str, bytes, int]]:
        for start, out, encoded in _chunks(root, split, count, fmt, workers):
            digest.update(np.ascontiguousarray(out.images).tobytes())
            rows.append((start, out._replace(images=out.images[:0], masks=out.masks[:0])))
            if progress is not None:
                progress(len(out.labels))
            yield from (("png", data, int(label)) for data, label in zip(encoded, out.labels))

    try:
        if fmt == "shards":
            write_shards(items(), root / split, 64 << 20)
        else:
            for _ in items():
                pass
    finally:
        _SCENES.pop(split, None)
    text = json.dumps(_coco(split, count, fmt, scenes.spec, rows), separators=(",", ":"))
    (root / "annotations" / f"instances_{split}.json").write_text(text, encoding="utf-8")
    return digest.hexdigest()


def write_wild(output: str | Path, spec: WildSpec, seed: int, counts: dict[str, int], photos: PhotoSet,
               fashion_path: str | None = None, fmt: str = "folder", workers: int = 1,
               progress: Callable[[int], None] | None = None, made_by: str = "") -> dict[str, Any]:
    """Write the wild set's ``counts`` images per split into ``output`` (a new or empty folder): the images (an
    ImageFolder tree ``<split>/<class folder>/NAME.png``, or tar shards ``<split>/shard-NNNNNN.tar`` for
    ``fmt="shards"``), ``annotations/instances_<split>.json`` (COCO boxes), ``annotations/<training|validation>/
    NAME.png`` (class maps in ADE20K's layout: 0 ignored, 1 background, 2-11 the garments) and ``dataset.json``
    (version, knobs, seed, photographs and their licence, each split's pixel digest). Built in a folder beside it
    and renamed when complete: ``output`` holds a whole set or nothing. Returns what ``dataset.json`` holds."""
    output = Path(output).expanduser()
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    meta: dict[str, Any] = {
        "name": WILD_NAME, "version": WILD_VERSION, "made_by": made_by, "seed": int(seed), "format": fmt,
        "counts": dict(counts), "spec": spec.describe(), "classes": list(FASHION_CLASSES),
        "class_folders": list(CLASS_FOLDERS),
        "garments": "image i of a split carries Fashion-MNIST's garment i mod N of the same split (train: its 60,000 "
                    "training images, test: its 10,000 test images) as its labelled garment",
        "photographs": photos.describe(),
        "segmentation": {"num_classes": 11, "classes": ["background", *FASHION_CLASSES], "reduce_zero_label": True,
                         "labels": "annotations/<training|validation>/NAME.png hold class + 1 (1 background, 2-11 the "
                                   "garments), 0 for faint pixels (ignored); read with reduce_zero_label"},
        "pixels_sha256": {}}
    try:
        for split, count in counts.items():
            garments = build_source("fashion_mnist", split, fashion_path)
            scenes = WildScenes(garments.images, garments.labels, photos.split(split), spec, seed, split, count)  # type: ignore[attr-defined]
            meta["pixels_sha256"][split] = _write_split(partial, scenes, split, fmt, workers, progress)
        (partial / FOLDER_META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        if output.exists():
            output.rmdir()  # empty: checked by the caller
        os.replace(partial, output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def is_wild(path: str | Path) -> bool:
    """Whether ``path`` is a folder that ``sslkit data wild`` wrote."""
    meta = Path(path).expanduser() / FOLDER_META
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("name") == WILD_NAME
    except (OSError, ValueError):
        return False


def _meta(root: Path) -> dict[str, Any]:
    return json.loads((root / FOLDER_META).read_text(encoding="utf-8"))


def wild_pairs(root: str | Path, split: str) -> list[tuple[Path, Path]]:
    """The (image, class map) files of a wild folder's ``split``, in index order (the folder layout only)."""
    root = Path(root).expanduser()
    meta = _meta(root)
    if meta.get("format") != "folder":
        raise DataSourceError(f"{root}: its images are in tar shards; the class maps pair with the folder layout "
                              "(write the set again with format=folder)")
    coco = json.loads((root / "annotations" / f"instances_{split}.json").read_text(encoding="utf-8"))
    maps = root / "annotations" / ADE_SPLITS[split]
    return [(root / im["file_name"], maps / Path(im["file_name"]).name) for im in coco["images"]]


def _decode_split(root: Path, meta: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    """Every image of a split decoded from its PNGs (or shards), in index order: uint8 ``[N, H, W, 3]``, labels."""
    from PIL import Image

    count, side = int(meta["counts"][split]), int(meta["spec"]["canvas"])
    images = np.empty((count, side, side, 3), dtype=np.uint8)
    labels = np.empty(count, dtype=np.int64)
    if meta.get("format") == "shards":
        from sslkit.data.shards import ShardDataset

        shards = ShardDataset(str(root / split))
        for i in range(count):
            image, labels[i] = shards[i]
            images[i] = image.permute(1, 2, 0).numpy()
        return images, labels
    for k, folder in enumerate(CLASS_FOLDERS):
        for path in (root / split / folder).iterdir():
            i = int(path.stem)
            with Image.open(path) as im:
                images[i] = np.asarray(im.convert("RGB"))
            labels[i] = k
    return images, labels


def read_wild_split(root: str | Path, split: str) -> TensorImageDataset:
    """A wild folder's ``split`` in memory: every image, in index order, with its label. Decoded from the files the
    first time, then kept as one array in the cache (``<cache>/wild/arrays/``, named by the split's pixel digest in
    ``dataset.json``: a set written again with other pixels is decoded again), read back in a fraction of a second."""
    root = Path(root).expanduser()
    meta = _meta(root)
    digest = str(meta.get("pixels_sha256", {}).get(split, ""))
    stored = cache_dir() / "wild" / "arrays" / f"{digest[:32]}-{split}.npz"
    arrays = None
    if digest and stored.is_file():
        try:
            with np.load(stored) as found:
                arrays = (found["images"], found["labels"])
        except (OSError, ValueError, KeyError):
            arrays = None  # a damaged copy: decoded again below
    if arrays is None:
        arrays = _decode_split(root, meta, split)
        if digest:
            try:
                save_arrays(stored, {"images": arrays[0], "labels": arrays[1]})
            except OSError as exc:  # a read-only cache: decoded each time
                logger.debug("wild: the decoded %s split is not kept (%s)", split, exc)
    images, labels = arrays
    return TensorImageDataset(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels),
                              num_classes=10)


def wild_cache(spec: WildSpec, seed: int, counts: dict[str, int], photos: str | None) -> Path:
    """The cache folder of a set with these knobs (under :func:`~sslkit.data.sources.cache_dir`), built there the
    first time (under a lock: one process builds, the others wait and read it)."""
    import fcntl

    key = json.dumps({"version": WILD_VERSION, "spec": spec.describe(), "seed": int(seed), "counts": counts,
                      "photos": photos}, sort_keys=True)
    root = cache_dir() / "wild"
    folder = root / f"v{WILD_VERSION}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if is_wild(folder):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_wild(folder):
            logger.info("data: building the wild set (%s) into %s, once", ", ".join(
                f"{n} {s}" for s, n in counts.items()), folder)
            if folder.exists():
                shutil.rmtree(folder)
            write_wild(folder, spec, seed, counts, load_photos(photos, spec.canvas, spec.zooms), fmt="folder",
                       workers=max(1, min(4, (os.cpu_count() or 1))), made_by=f"sslkit data source wild, {key}")
    return folder


@register_dataset("wild")
def build_wild(split: str, path: str | None = None, seed: int = 0, train: int = DEFAULT_COUNTS["train"],
               test: int = DEFAULT_COUNTS["test"],
               photos: str | None = None, channels: int = 3, **knobs: Any) -> TensorImageDataset:
    """Fashion-MNIST in the wild (``data=wild``; 10 classes, RGB): the folder ``path`` that ``sslkit data wild``
    wrote, or, without a path, the set of these knobs (``seed``, ``train`` / ``test`` images, ``photos``, and
    :class:`~sslkit.data.wild.WildSpec`'s: canvas, scale, rotation, ...) built once into the cache."""
    if int(channels) != 3:
        raise DataSourceError(f"the wild set's images are RGB: channels={channels} cannot be read from it (leave "
                              f"data.{split}.kwargs.channels unset)")
    return read_wild_split(wild_folder(path, seed=seed, train=train, test=test, photos=photos, **knobs), split)


def wild_folder(path: str | None, seed: int = 0, train: int = DEFAULT_COUNTS["train"],
                test: int = DEFAULT_COUNTS["test"], photos: str | None = None, **knobs: Any) -> Path:
    """The folder of a wild set: ``path`` (checked to be one ``sslkit data wild`` wrote), or, without it, the set of
    these knobs in the cache, built there the first time (:func:`wild_cache`)."""
    if path:
        if not is_wild(path):
            raise DataSourceError(f"{path} is not a folder that `sslkit data wild` wrote (no dataset.json naming "
                                  f"{WILD_NAME}): write one with `sslkit data wild output={path}`, or leave the path "
                                  "unset to build the set into the cache")
        return Path(path).expanduser()
    return wild_cache(WildSpec(**knobs), seed, {"train": int(train), "test": int(test)}, photos)
