"""The photographs the wild set (:mod:`sslkit.data.wild`) blends its garments into: a folder of natural images (by
default the nature set of Debian's ``mate-backgrounds``), or dead leaves drawn from a fixed seed when none is
installed; split into disjoint train and test photographs and kept as a few downscaled levels to crop from."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sslkit.data.seeding import hashed_uniforms
from sslkit.errors import UserError

__all__ = ["DEAD_LEAVES", "DEFAULT_PHOTOS", "MATE_LICENCE", "Photo", "PhotoError", "PhotoSet", "dead_leaves",
           "load_photos", "photo_levels", "split_photos"]

#: Where Debian's ``mate-backgrounds`` installs its twelve nature photographs (``apt-get install mate-backgrounds``).
DEFAULT_PHOTOS = "/usr/share/backgrounds/mate/nature"
#: Their licence, from the package's ``/usr/share/doc/mate-backgrounds/copyright``.
MATE_LICENCE = ("GPL-2+ (Debian package mate-backgrounds 1.26, nature/*.jpg: photographs by Charles Barbin, "
                "Lennart Poettering and Andrea Cimitan, Marco Cogoni and Hylke Bons, Jens Ansorg, Timothy Schellhase "
                "and Lapo Calamandrei, blackcombwhistler07, Sergey Nazarov, Jean-Francois Fortin Tam; "
                "/usr/share/doc/mate-backgrounds/copyright)")
#: The ``photos=`` value that asks for the procedural photographs (also the fallback when the default is missing).
DEAD_LEAVES = "dead_leaves"
#: How many dead-leaves images stand in for photographs (as many as the mate nature set has).
DEAD_LEAVES_COUNT = 12
#: The side of a dead-leaves image before it is brought to the levels.
DEAD_LEAVES_SIDE = 512
#: The file types read from a photograph folder.
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")

class PhotoError(UserError, ValueError):
    """The photographs cannot be used (no readable image, too few for disjoint splits)."""


@dataclass(frozen=True)
class Photo:
    """One photograph: its name, its file's SHA-256 (None for a drawn one) and its levels: uint8 ``[H, W, 3]``
    copies whose shorter side is ``canvas x zoom`` for each zoom."""

    name: str
    levels: tuple[np.ndarray, ...]
    file_sha256: str | None

    def pixels_sha256(self) -> str:
        """The SHA-256 of the levels' pixels: what the images are made from (a decoder of another version that
        reads the file differently changes it)."""
        digest = hashlib.sha256()
        for level in self.levels:
            digest.update(np.ascontiguousarray(level).tobytes())
        return digest.hexdigest()


@dataclass(frozen=True)
class PhotoSet:
    """The photographs of both splits (disjoint), where they came from and under which licence."""

    origin: str
    licence: str
    train: tuple[Photo, ...]
    test: tuple[Photo, ...]

    def split(self, split: str) -> tuple[Photo, ...]:
        """The photographs of ``split`` ("train" or "test")."""
        return self.train if split == "train" else self.test

    def describe(self) -> dict[str, Any]:
        """What ``dataset.json`` records of them."""
        def rows(photos: tuple[Photo, ...]) -> list[dict[str, Any]]:
            return [{"name": p.name, "file_sha256": p.file_sha256, "pixels_sha256": p.pixels_sha256()}
                    for p in photos]

        return {"origin": self.origin, "licence": self.licence, "train": rows(self.train), "test": rows(self.test)}


def photo_levels(rgb: np.ndarray, canvas: int, zooms: Sequence[int]) -> tuple[np.ndarray, ...]:
    """``rgb`` (uint8 ``[H, W, 3]``) resized so that its shorter side is ``canvas x zoom``, for each zoom (Pillow's
    box filter: each output pixel the mean of the input pixels it covers)."""
    from PIL import Image

    image = Image.fromarray(rgb)
    out = []
    for zoom in zooms:
        short = int(canvas * zoom)
        w, h = image.size
        size = (short, max(short, round(h * short / w))) if w <= h else (max(short, round(w * short / h)), short)
        out.append(np.asarray(image.resize(size, Image.Resampling.BOX)).copy())
    return tuple(out)


def dead_leaves(index: int, side: int = DEAD_LEAVES_SIDE) -> np.ndarray:
    """Dead leaves image ``index`` (Baradad et al. 2021, "Learning to See by Looking at Noise"): discs and squares of
    uniformly random colours and radii drawn from a power law ``p(r) ~ r^-3`` (between ``side / 256`` and
    ``side / 4``), each falling on the ones before, until 4,000 have fallen. uint8 ``[side, side, 3]``, the same on
    every machine (integer and elementwise arithmetic only)."""
    count = 4000
    u = hashed_uniforms((0x5EAF, index), np.arange(count), 6)
    r_min, r_max = side / 256.0, side / 4.0
    # inverse CDF of p(r) ~ r^-3 on [r_min, r_max]
    radii = 1.0 / np.sqrt(1.0 / r_min**2 - u[:, 0] * (1.0 / r_min**2 - 1.0 / r_max**2))
    image = np.zeros((side, side, 3), dtype=np.uint8)
    image[:] = (u[0, 3:6] * 256).astype(np.uint8)
    for k in range(count):
        r, cy, cx = radii[k], u[k, 1] * side, u[k, 2] * side
        colour = np.minimum(u[k, 3:6] * 256, 255).astype(np.uint8)
        y0, y1 = max(0, math.floor(cy - r)), min(side, math.ceil(cy + r) + 1)
        x0, x1 = max(0, math.floor(cx - r)), min(side, math.ceil(cx + r) + 1)
        if y0 >= y1 or x0 >= x1:
            continue
        if k % 2:  # a square: the bounding box itself
            image[y0:y1, x0:x1] = colour
            continue
        yy = (np.arange(y0, y1, dtype=np.float64) + 0.5 - cy)[:, None]
        xx = (np.arange(x0, x1, dtype=np.float64) + 0.5 - cx)[None, :]
        inside = yy * yy + xx * xx <= r * r
        image[y0:y1, x0:x1][inside] = colour
    return image


def split_photos(names: Sequence[str]) -> tuple[list[int], list[int]]:
    """Disjoint train and test photographs among ``names`` (their positions in sorted order): every third one
    (the 3rd, 6th, ...) is a test photograph, the others train ones; with two, one each. Needs two or more."""
    order = sorted(range(len(names)), key=lambda k: names[k])
    if len(order) < 2:
        raise PhotoError(f"{len(order)} photograph(s): disjoint train and test photographs need at least 2")
    test = order[2::3] if len(order) >= 3 else order[1:]
    train = [k for k in order if k not in set(test)]
    return train, test


def _read_folder(folder: Path) -> list[tuple[str, np.ndarray, str]]:
    """Every readable image of ``folder`` (not its sub-folders) as (name, uint8 RGB, file SHA-256), by name."""
    from PIL import Image, UnidentifiedImageError

    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise PhotoError(f"photos={folder} {what}: give a folder of photographs (JPEG, PNG, ...), or "
                         f"photos={DEAD_LEAVES} for drawn ones")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in PHOTO_SUFFIXES)
    found = []
    for path in files:
        data = path.read_bytes()
        try:
            import io

            with Image.open(io.BytesIO(data)) as im:
                rgb = np.asarray(im.convert("RGB")).copy()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            continue
        found.append((path.name, rgb, hashlib.sha256(data).hexdigest()))
    if not found:
        raise PhotoError(f"photos={folder}: no readable image among its {len(files)} image file(s) "
                         f"({', '.join(PHOTO_SUFFIXES)}): give a folder of photographs, or photos={DEAD_LEAVES}")
    return found


def load_photos(photos: str | None, canvas: int, zooms: Sequence[int], licence: str | None = None) -> PhotoSet:
    """The photographs named by ``photos``: a folder (its readable images; ``licence`` is recorded with them), the
    default :data:`DEFAULT_PHOTOS` when None (dead leaves when it is not installed, with a warning), or
    :data:`DEAD_LEAVES`. Each is brought to its levels (:func:`photo_levels`) and assigned to a split
    (:func:`split_photos`)."""
    import logging

    if photos is None and not Path(DEFAULT_PHOTOS).is_dir():
        logging.getLogger("sslkit").warning(
            "wild: %s is not installed (apt-get install mate-backgrounds): the photographs are dead leaves instead",
            DEFAULT_PHOTOS)
        photos = DEAD_LEAVES
    if photos == DEAD_LEAVES:
        items = [(f"dead_leaves_{k:02d}", dead_leaves(k), None) for k in range(DEAD_LEAVES_COUNT)]
        origin, licence = DEAD_LEAVES, "procedural (drawn by sslkit from a fixed seed): no licence needed"
    else:
        folder = Path(photos or DEFAULT_PHOTOS).expanduser()
        items = _read_folder(folder)
        origin = str(folder)
        if licence is None:
            licence = MATE_LICENCE if photos is None else "not stated (the folder's own terms apply)"
    names = [name for name, _, _ in items]
    try:
        train, test = split_photos(names)
    except PhotoError as exc:
        raise PhotoError(f"photos={origin}: {exc}; give a folder with more photographs") from None

    def made(k: int) -> Photo:
        name, rgb, digest = items[k]
        return Photo(name, photo_levels(rgb, canvas, zooms), digest)

    return PhotoSet(origin, str(licence), tuple(made(k) for k in train), tuple(made(k) for k in test))
