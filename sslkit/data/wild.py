"""Fashion-MNIST in the wild, sslkit's proving ground: each garment scaled, rotated, tinted and placed on a canvas
cropped from a natural photograph, blended MNIST-M's way (``|photo - garment|`` per channel; Ganin & Lempitsky 2015,
section 5), beside partly visible distractor garments of other classes. Image ``i`` of a split is a pure function of
(version, knobs, photographs, seed, split, i): the knobs (:class:`WildSpec`) and the renderer (:class:`WildScenes`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from sslkit.data.photos import Photo
from sslkit.data.seeding import hashed_uniforms
from sslkit.data.segmentation import IGNORE_INDEX
from sslkit.errors import UserError

__all__ = ["SPLIT_CODES", "WILD_VERSION", "Rendered", "WildObject", "WildScenes", "WildSpec", "WildSpecError"]

#: The images' version: raised whenever the same (knobs, photographs, seed, split, index) would give other pixels
#: (a renderer change, a new default), and written into every set's ``dataset.json``.
WILD_VERSION = 1
#: Each split's own stream of the seed.
SPLIT_CODES = {"train": 0, "test": 1}
#: The side of a Fashion-MNIST garment, and its padding in the sampler (so out-of-range taps read zeros).
GARMENT = 28
_PAD = 2
#: Uniforms drawn per image before the garments' (photo, level, crop y, crop x, flip, distractor count), and per
#: garment slot (size, angle, hue, saturation, value, three placement draws, class, garment).
_IMAGE_WORDS = 6
_SLOT_WORDS = 10


class WildSpecError(UserError, ValueError):
    """A knob of the generator out of its range; the message names it and what to give."""


@dataclass(frozen=True)
class WildSpec:
    """The generator's knobs. Garments are Fashion-MNIST's 28 px frames scaled by ``scale`` (so a canvas must hold
    ``28 x scale[1]`` pixels), turned by up to ``rotation`` degrees either way, tinted with a colour of random hue
    and of ``saturation`` and ``value`` (HSV) drawn from their ranges, and placed wholly on the canvas; between
    ``distractors[0]`` and ``distractors[1]`` garments of other classes lie beneath it, each centred within
    ``reach`` of its frame's side from a canvas edge (inside or out), so that a quarter to three quarters of its
    frame shows. The photograph is cropped at one of ``zooms`` (its shorter side ``canvas x zoom``: a larger zoom,
    finer texture) and mirrored at random. ``blend``: ``difference`` (MNIST-M: ``|photo - garment|``) or ``over``
    (the garment pasted over the photograph, its intensity as opacity). A pixel where a garment's intensity is above
    ``threshold`` is that garment's in the class map; a fainter lit pixel is ignored there. The defaults were chosen
    by measurement (docs/results.md, "The proving ground": trials of SimCLR on each setting)."""

    canvas: int = 32
    scale: tuple[float, float] = (0.8, 1.0)
    rotation: float = 20.0
    saturation: tuple[float, float] = (0.0, 1.0)
    value: tuple[float, float] = (0.5, 1.0)
    distractors: tuple[int, int] = (0, 1)
    reach: float = 0.25
    zooms: tuple[int, ...] = (2, 4, 8)
    blend: str = "difference"
    threshold: float = 0.1

    def __post_init__(self) -> None:
        for key in ("scale", "saturation", "value"):
            object.__setattr__(self, key, tuple(float(v) for v in getattr(self, key)))
        object.__setattr__(self, "distractors", tuple(int(v) for v in self.distractors))
        object.__setattr__(self, "zooms", tuple(self.zooms))
        def bad(key: str, what: str) -> WildSpecError:
            return WildSpecError(f"{key}={getattr(self, key)}: {what}")

        if not isinstance(self.canvas, int) or self.canvas < 1:
            raise bad("canvas", "give a whole number of pixels (32 by default)")
        lo, hi = self.scale
        if not 0 < lo <= hi:
            raise bad("scale", "give [low,high] with 0 < low <= high (the garments' 28 px frame times it)")
        if self.canvas < math.ceil(GARMENT * hi):
            raise bad("canvas", f"smaller than a garment ({GARMENT} px x scale {hi:g} = "
                                f"{math.ceil(GARMENT * hi)} px): give canvas={math.ceil(GARMENT * hi)} or more, or a "
                                "smaller scale=[low,high]")
        if not 0 <= self.rotation <= 180:
            raise bad("rotation", "give degrees in [0, 180]")
        for key in ("saturation", "value"):
            a, b = getattr(self, key)
            if not 0 <= a <= b <= 1:
                raise bad(key, "give [low,high] with 0 <= low <= high <= 1")
        d0, d1 = self.distractors
        if not 0 <= d0 <= d1 <= 8:
            raise bad("distractors", "give [fewest,most] with 0 <= fewest <= most <= 8")
        if not 0 <= self.reach <= 0.5:
            raise bad("reach", "give a fraction of a garment's side in [0, 0.5]")
        if not self.zooms or any(int(z) != z or z < 1 for z in self.zooms):
            raise bad("zooms", "give whole numbers >= 1, e.g. [2,4,8]")
        if self.blend not in ("difference", "over"):
            raise bad("blend", "give difference (MNIST-M's |photo - garment|) or over")
        if not 0 <= self.threshold < 1:
            raise bad("threshold", "give a fraction of full intensity in [0, 1)")

    @property
    def slots(self) -> int:
        """Garments drawn per image at most: the main one and the most distractors."""
        return 1 + int(self.distractors[1])

    def describe(self) -> dict[str, Any]:
        """The knobs as ``dataset.json`` records them."""
        out = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


class WildObject(NamedTuple):
    """One garment of an image as its annotations give it: class (0-9), the Fashion-MNIST index of the split it
    came from, its visible pixels' box ``(x, y, w, h)`` and count, and whether it is the image's labelled garment."""

    category: int
    garment: int
    box: tuple[int, int, int, int]
    area: int
    main: bool


class Rendered(NamedTuple):
    """A batch of images as the renderer gives them: uint8 ``[B, H, W, 3]``, class maps ``[B, H, W]`` (uint8:
    0 background, class + 1 for a garment's pixels, :data:`~sslkit.data.segmentation.IGNORE_INDEX` for faint ones),
    labels ``[B]`` and each image's visible garments."""

    images: np.ndarray
    masks: np.ndarray
    labels: np.ndarray
    objects: list[list[WildObject]]


def _hsv_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HSV (each in [0, 1)) to RGB in [0, 1], elementwise: ``[..., 3]``."""
    h6 = h * 6.0
    sector = np.floor(h6)
    f = h6 - sector
    p, q, t = v * (1.0 - s), v * (1.0 - s * f), v * (1.0 - s * (1.0 - f))
    table = np.stack([np.stack(c, -1) for c in ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))])
    return np.take_along_axis(table, sector.astype(np.int64)[None, ..., None].clip(0, 5), 0)[0]


class WildScenes(Dataset):
    """The images of one split: image ``i`` carries garment ``i`` of the split's Fashion-MNIST images (modulo their
    number) as its labelled garment, on a crop of one of ``photos`` (the split's own: train and test photographs are
    disjoint), drawn from the uniforms of (version, ``seed``, split, ``i``) alone, so any index renders alone, in any
    batch, process or order, to the same pixels. Items are (uint8 ``[3, H, W]``, label), as every source's."""

    num_classes = 10
    channels = 3

    def __init__(self, garments: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray,
                 photos: Sequence[Photo], spec: WildSpec, seed: int, split: str, count: int) -> None:
        garments = np.asarray(garments, dtype=np.uint8).reshape(-1, GARMENT, GARMENT)
        self.garment_labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if len(garments) != len(self.garment_labels) or not len(garments):
            raise ValueError(f"{len(garments)} garments and {len(self.garment_labels)} labels")
        if not photos:
            raise ValueError("no photographs")
        padded = np.zeros((len(garments), GARMENT + 2 * _PAD, GARMENT + 2 * _PAD), dtype=np.uint8)
        padded[:, _PAD:-_PAD, _PAD:-_PAD] = garments
        self.padded = padded
        self.by_class = [np.flatnonzero(self.garment_labels == c) for c in range(10)]
        if any(len(ix) == 0 for ix in self.by_class):
            raise ValueError("the wild set needs garments of each of Fashion-MNIST's 10 classes")
        self.photos, self.spec, self.seed, self.split = tuple(photos), spec, int(seed), split
        self.count = int(count)
        self.key = (WILD_VERSION, self.seed, SPLIT_CODES[split])
        self.labels = torch.from_numpy(self.garment_labels[np.arange(self.count) % len(garments)])

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.count:
            raise IndexError(f"image {i} of {self.count}")
        out = self.render(np.array([i]))
        return torch.from_numpy(out.images[0]).permute(2, 0, 1).contiguous(), int(out.labels[0])

    def _backgrounds(self, u: np.ndarray) -> np.ndarray:
        """Each image's photograph crop, float32 ``[B, C, C, 3]``."""
        c = self.spec.canvas
        out = np.empty((len(u), c, c, 3), dtype=np.float32)
        for b, row in enumerate(u):
            photo = self.photos[int(row[0] * len(self.photos))]
            level = photo.levels[int(row[1] * len(photo.levels))]
            y = int(row[2] * (level.shape[0] - c + 1))
            x = int(row[3] * (level.shape[1] - c + 1))
            crop = level[y:y + c, x:x + c]
            out[b] = crop[:, ::-1] if row[4] < 0.5 else crop
        return out

    def _slots(self, indices: np.ndarray, u: np.ndarray) -> dict[str, np.ndarray]:
        """Every garment slot's draw ``[B, K]``: garment, class, active, scale, angle, centre, tint."""
        spec, c, k = self.spec, float(self.spec.canvas), self.spec.slots
        s = u[:, _IMAGE_WORDS:].reshape(len(u), k, _SLOT_WORDS)
        main = indices % len(self.garment_labels)
        main_class = self.garment_labels[main]
        classes = (main_class[:, None] + 1 + (s[:, :, 8] * 9).astype(np.int64)) % 10
        classes[:, 0] = main_class
        garment = np.empty_like(classes)
        garment[:, 0] = main
        for b in range(len(u)):
            for j in range(1, k):
                pool = self.by_class[classes[b, j]]
                garment[b, j] = pool[int(s[b, j, 9] * len(pool))]
        d0, d1 = spec.distractors
        drawn = d0 + (u[:, 5] * (d1 - d0 + 1)).astype(np.int64)
        active = np.arange(k)[None, :] <= drawn[:, None]
        scale = spec.scale[0] + s[:, :, 0] * (spec.scale[1] - spec.scale[0])
        angle = (2.0 * s[:, :, 1] - 1.0) * math.radians(spec.rotation)
        frame = GARMENT * scale
        cy = frame / 2 + s[:, :, 5] * (c - frame)
        cx = frame / 2 + s[:, :, 6] * (c - frame)
        side = (s[:, :, 7] * 4).astype(np.int64)
        along, depth = s[:, :, 5] * c, (2.0 * s[:, :, 6] - 1.0) * spec.reach * frame
        edge_y = np.choose(side.clip(0, 3), [depth, c - depth, along, along])
        edge_x = np.choose(side.clip(0, 3), [along, along, depth, c - depth])
        cy[:, 1:], cx[:, 1:] = edge_y[:, 1:], edge_x[:, 1:]
        sat = spec.saturation[0] + s[:, :, 3] * (spec.saturation[1] - spec.saturation[0])
        val = spec.value[0] + s[:, :, 4] * (spec.value[1] - spec.value[0])
        tint = _hsv_to_rgb(s[:, :, 2], sat, val)
        return {"garment": garment, "class": classes, "active": active, "scale": scale, "angle": angle,
                "cy": cy, "cx": cx, "tint": tint}

    def _intensities(self, slot: dict[str, np.ndarray]) -> np.ndarray:
        """Each slot's garment intensity on the canvas ``[B, K, C, C]`` (float32 in [0, 1]): the canvas pixel's centre
        mapped back into the garment's frame (turned by minus the angle, divided by the scale) and read bilinearly;
        0 off the garment and for inactive slots."""
        c, b, k = self.spec.canvas, *slot["garment"].shape
        # the inverse map's coefficients in float64 (cos and sin of each slot through Python's math, not numpy's
        # vectorised ones, whose last bit may depend on the CPU's instruction set), then float32
        cos = np.array([math.cos(t) for t in slot["angle"].reshape(-1)]).reshape(b, k)
        sin = np.array([math.sin(t) for t in slot["angle"].reshape(-1)]).reshape(b, k)
        a = (cos / slot["scale"]).astype(np.float32).reshape(b * k, 1, 1)
        e = (sin / slot["scale"]).astype(np.float32).reshape(b * k, 1, 1)
        grid = np.arange(c, dtype=np.float32) + np.float32(0.5)
        dy = grid[None, :, None] - slot["cy"].astype(np.float32).reshape(b * k, 1, 1)
        dx = grid[None, None, :] - slot["cx"].astype(np.float32).reshape(b * k, 1, 1)
        half = np.float32(GARMENT / 2 - 0.5)  # pixel centres: the frame's middle at 13.5 in index units
        qy = a * dy + e * dx + half
        qx = a * dx - e * dy + half
        y0, x0 = np.floor(qy), np.floor(qx)
        wy, wx = qy - y0, qx - x0
        side = GARMENT + 2 * _PAD
        iy = np.clip(y0.astype(np.int64) + _PAD, 0, side - 2)
        ix = np.clip(x0.astype(np.int64) + _PAD, 0, side - 2)
        flat = iy * side + ix + (np.arange(b * k) * side * side)[:, None, None]
        pixels = self.padded[slot["garment"].reshape(-1)].reshape(-1).astype(np.float32) / np.float32(255.0)
        v00, v01 = pixels[flat], pixels[flat + 1]
        v10, v11 = pixels[flat + side], pixels[flat + side + 1]
        top = v00 + (v01 - v00) * wx
        bottom = v10 + (v11 - v10) * wx
        out = (top + (bottom - top) * wy).reshape(b, k, c, c)
        return out * slot["active"][:, :, None, None].astype(np.float32)

    def render(self, indices: np.ndarray) -> Rendered:
        """Images ``indices`` (each in [0, len)), their class maps, labels and visible garments."""
        indices = np.asarray(indices, dtype=np.int64)
        spec, k = self.spec, self.spec.slots
        u = hashed_uniforms(self.key, indices, _IMAGE_WORDS + k * _SLOT_WORDS)
        background = self._backgrounds(u)
        slot = self._slots(indices, u)
        intensity = self._intensities(slot)
        b, c = len(indices), spec.canvas
        colour = np.zeros((b, c, c, 3), dtype=np.float32)
        alpha = np.zeros((b, c, c, 1), dtype=np.float32)
        owner = np.full((b, c, c), -1, dtype=np.int64)
        lit = np.zeros((b, c, c), dtype=bool)
        tint = slot["tint"].astype(np.float32)
        for j in reversed(range(k)):  # the distractors first, the labelled garment on top
            level = intensity[:, j, :, :, None]
            colour += level * (tint[:, j, None, None, :] - colour)
            alpha += level * (1.0 - alpha)
            owner[intensity[:, j] > spec.threshold] = j
            lit |= intensity[:, j] > 0
        if spec.blend == "difference":
            pixels = np.abs(background - np.float32(255.0) * colour)
        else:
            pixels = np.float32(255.0) * colour + (1.0 - alpha) * background
        images = np.rint(np.clip(pixels, 0, 255)).astype(np.uint8)
        category = np.take_along_axis(slot["class"], owner.clip(0).reshape(b, -1), 1).reshape(b, c, c)
        masks = np.where(owner >= 0, category + 1, np.where(lit, IGNORE_INDEX, 0)).astype(np.uint8)
        return Rendered(images, masks, slot["class"][:, 0].copy(), _objects(owner, slot))


def _objects(owner: np.ndarray, slot: dict[str, np.ndarray]) -> list[list[WildObject]]:
    """Each image's garments with a visible pixel (labelled one first): their boxes and pixel counts."""
    b, k = slot["garment"].shape
    c = owner.shape[-1]
    mine = owner[:, None] == np.arange(k)[None, :, None, None]  # [B, K, C, C]
    rows, cols = mine.any(3), mine.any(2)
    area = mine.sum((2, 3))
    y0, y1 = rows.argmax(2), c - 1 - rows[:, :, ::-1].argmax(2)
    x0, x1 = cols.argmax(2), c - 1 - cols[:, :, ::-1].argmax(2)
    out = []
    for i in range(b):
        out.append([WildObject(int(slot["class"][i, j]), int(slot["garment"][i, j]),
                               (int(x0[i, j]), int(y0[i, j]), int(x1[i, j] - x0[i, j] + 1),
                                int(y1[i, j] - y0[i, j] + 1)), int(area[i, j]), j == 0)
                    for j in range(k) if area[i, j] > 0])
    return out
