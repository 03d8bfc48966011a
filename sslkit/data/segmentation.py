"""Segmentation sets for the dense probe: images with per-pixel class maps (an ADE20K-layout folder, or
Fashion-MNIST's images with each object pixel labelled by the image's class), and their joint resize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from sslkit.data.transforms import Normalize

__all__ = ["FASHION_CLASSES", "IGNORE_INDEX", "IMAGE_SUFFIXES", "FashionMNISTScenes", "FashionMNISTSegmentation",
           "SegmentationFolder", "SegmentationTransform", "TransformedSegmentation", "folder_classes",
           "split_scenes", "stored_class_map", "write_segmentation_folder"]

#: The label of pixels no class is scored on (ADE20K's "other" after ``reduce_zero_label``, mmseg's convention).
IGNORE_INDEX = 255
#: The image files a segmentation folder reads.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
#: A folder split's sub-folder name in the ADE20K layout.
ADE_SPLITS = {"train": "training", "test": "validation"}
#: What a segmentation folder written by sslkit says of itself (its classes), beside images/ and annotations/.
FOLDER_META = "dataset.json"
#: Fashion-MNIST's classes, in label order.
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot")


class FashionMNISTSegmentation(Dataset):
    """Fashion-MNIST as a segmentation set that needs no download: every pixel brighter than ``threshold`` (of 1.0)
    is the image's object and takes its class ``label + 1``; the others are background, class 0. Eleven classes.
    The threshold is stated in the results (``eval.dense.threshold``, 0.1 by default: the garments lie on a black
    background, 0 exactly for most of it)."""

    num_classes = 11

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, threshold: float = 0.1) -> None:
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"eval.dense.threshold must be in [0, 1), got {threshold}")
        self.images, self.labels, self.threshold = images, labels.to(torch.int64), float(threshold)
        self.channels = int(images.shape[1])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 image ``[1, 28, 28]`` and its class map ``[28, 28]`` (int64)."""
        image = self.images[i]
        mask = torch.where(image[0].float() > self.threshold * 255.0, self.labels[i] + 1, 0)
        return image.clone(), mask


class SegmentationFolder(Dataset):
    """Images and class-map PNGs in ADE20K's layout: ``ROOT/images/{training,validation}/NAME.jpg`` with
    ``ROOT/annotations/{training,validation}/NAME.png`` (the same stem; split ``train`` reads ``training``, ``test``
    ``validation``). With ``reduce_zero_label`` (ADE20K's 0 is "other") label 0 is ignored and the others shift
    down by one, as mmsegmentation and DINOv3 read ADE20K."""

    def __init__(self, root: str | Path, split: str, reduce_zero_label: bool = True) -> None:
        root = Path(root).expanduser()
        sub = ADE_SPLITS.get(split, split)
        images, annotations = root / "images" / sub, root / "annotations" / sub
        for folder in (images, annotations):
            if not folder.is_dir():
                raise FileNotFoundError(f"{folder}: no such folder; a segmentation folder has images/{sub}/ and "
                                        f"annotations/{sub}/ (ADE20K's layout: ADEChallengeData2016)")
        self.pairs: list[tuple[Path, Path]] = []
        missing = []
        for image in sorted(p for p in images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            mask = annotations / f"{image.stem}.png"
            (self.pairs.append((image, mask)) if mask.is_file() else missing.append(image.name))
        if missing:
            raise FileNotFoundError(f"{annotations}: no class map for {len(missing)} image(s) of {images} "
                                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): each image "
                                    "needs annotations/<split>/<its name>.png")
        if not self.pairs:
            raise FileNotFoundError(f"{images}: no images ({', '.join(IMAGE_SUFFIXES)})")
        self.reduce_zero_label = bool(reduce_zero_label)
        self.channels = 3

    @classmethod
    def from_pairs(cls, pairs: list[tuple[Path, Path]], reduce_zero_label: bool = True) -> SegmentationFolder:
        """The (image, class map) files ``pairs`` read as a folder in ADE20K's layout reads them (the wild set's
        images lie in an ImageFolder tree, its class maps in ``annotations/``)."""
        missing = [str(p) for pair in pairs for p in pair if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} image or class map file(s) missing: "
                                    f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
        out = cls.__new__(cls)
        out.pairs, out.reduce_zero_label, out.channels = list(pairs), bool(reduce_zero_label), 3
        return out

    def __len__(self) -> int:
        return len(self.pairs)

    def mismatched(self) -> list[str]:
        """The images whose class map is not of their size (read from the files' headers, nothing decoded), as
        ``NAME (image WxH, map WxH)``."""
        from PIL import Image

        bad = []
        for image, mask in self.pairs:
            with Image.open(image) as a, Image.open(mask) as b:
                if a.size != b.size:
                    bad.append(f"{image.name} (image {a.size[0]}x{a.size[1]}, map {b.size[0]}x{b.size[1]})")
        return bad

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 RGB image ``[3, H, W]`` and its class map ``[H, W]`` (int64, :data:`IGNORE_INDEX` where unscored)."""
        import numpy as np
        from PIL import Image

        image_path, mask_path = self.pairs[i]
        with Image.open(image_path) as im:
            image = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()
        with Image.open(mask_path) as im:
            mask = torch.from_numpy(np.asarray(im).astype(np.int64))
        if mask.ndim != 2 or mask.shape != image.shape[1:]:
            raise ValueError(f"{mask_path}: a class map must be one channel of the image's size "
                             f"{tuple(image.shape[1:])}, got {tuple(mask.shape)}")
        if self.reduce_zero_label:
            mask = torch.where(mask == 0, IGNORE_INDEX, mask - 1)
        return image, mask


class SegmentationTransform:
    """An image and its class map brought to ``size x size``: the image resized bilinearly (antialiased when it
    shrinks) and normalised as sslkit's transforms normalise (:class:`~sslkit.data.transforms.Normalize`), the class
    map resized to the same grid by nearest neighbour (a label is never blended). A gray image is repeated to
    ``channels`` = 3 for an RGB trunk (Fashion-MNIST's garments under a run trained on colour images)."""

    def __init__(self, size: int, mean: Any = None, std: Any = None, channels: int | None = None) -> None:
        self.size = int(size)
        self.normalize, self.channels = Normalize(mean, std), channels

    def __call__(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = image.to(torch.float32).div(255.0) if image.dtype == torch.uint8 else image.to(torch.float32, copy=True)
        if self.channels is not None and x.shape[0] != self.channels:
            if x.shape[0] != 1:
                raise ValueError(f"the segmentation images have {x.shape[0]} channels and the trunk takes "
                                 f"{self.channels}")
            x = x.expand(self.channels, -1, -1).contiguous()
        s = self.size
        if tuple(x.shape[1:]) != (s, s):
            down = x.shape[1] > s or x.shape[2] > s
            x = F.interpolate(x[None], size=(s, s), mode="bilinear", align_corners=False, antialias=down)[0]
            mask = F.interpolate(mask[None, None].float(), size=(s, s), mode="nearest")[0, 0].to(torch.int64)
        return self.normalize(x), mask


class TransformedSegmentation(Dataset):
    """``dataset`` with ``transform`` applied to each (image, class map) pair."""

    def __init__(self, dataset: Dataset, transform: SegmentationTransform) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(*self.dataset[i])


class FashionMNISTScenes(Dataset):
    """Scenes composed from Fashion-MNIST, a dense task that needs patch semantics: on a black ``canvas`` x
    ``canvas`` image, ``min_garments`` to ``max_garments`` garments of different classes, each a 28 x 28 image of the
    split drawn at random, each in its own cell of a 2 x 2 (or larger) grid of 28-pixel cells, shifted by up to
    ``jitter`` pixels. A pixel above ``threshold`` (of 1.0) of a garment takes that garment's class + 1 (the one
    pasted last where two meet), a pixel nothing covers is background (class 0), and a faint pixel (lit, at most
    the threshold: a garment's soft edge) is :data:`IGNORE_INDEX`. One class per garment, several classes per
    image and the same outline for several classes: a threshold cannot tell them apart, the patches must know what
    they belong to. Scene ``i`` is drawn from ``seed`` and ``i`` alone (the same on every machine and in any
    order), so nothing is stored; ``sslkit data scenes`` writes them in ADE20K's layout."""

    num_classes = 11
    #: the side of a Fashion-MNIST image and of a cell of the scene's grid
    cell = 28

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, count: int, canvas: int = 56,
                 min_garments: int = 2, max_garments: int = 4, jitter: int = 6, threshold: float = 0.1,
                 seed: int = 0) -> None:
        cells = (canvas // self.cell) ** 2
        if canvas < self.cell or canvas % self.cell:
            raise ValueError(f"the scene canvas must be a multiple of {self.cell} pixels, got {canvas}")
        if not 1 <= min_garments <= max_garments <= min(cells, 10):
            raise ValueError(f"garments per scene: need 1 <= min ({min_garments}) <= max ({max_garments}) <= "
                             f"{min(cells, 10)} (the canvas's {cells} cells, 10 classes)")
        if not 0.0 <= threshold < 1.0 or count < 1 or jitter < 0:
            raise ValueError(f"scenes: count ({count}) >= 1, jitter ({jitter}) >= 0 and threshold ({threshold}) in "
                             "[0, 1) needed")
        self.images, self.labels = images, labels.to(torch.int64)
        self.count, self.canvas, self.jitter, self.threshold = int(count), int(canvas), int(jitter), float(threshold)
        self.garments, self.seed, self.channels = (int(min_garments), int(max_garments)), int(seed), 1
        self.by_class = [torch.nonzero(self.labels == c).flatten() for c in range(10)]
        if any(len(ix) == 0 for ix in self.by_class):
            raise ValueError("scenes need images of each of Fashion-MNIST's 10 classes")

    def __len__(self) -> int:
        return self.count

    def layout(self, i: int) -> list[tuple[int, int, int, int]]:
        """Scene ``i``'s garments, in pasting order: (image index, class, top, left)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        side = self.canvas // self.cell
        n = int(torch.randint(self.garments[0], self.garments[1] + 1, (1,), generator=g))
        classes = torch.randperm(10, generator=g)[:n].tolist()
        cells = torch.randperm(side * side, generator=g)[:n].tolist()
        out = []
        for c, cell in zip(classes, cells):
            pool = self.by_class[c]
            index = int(pool[int(torch.randint(len(pool), (1,), generator=g))])
            shift = torch.randint(-self.jitter, self.jitter + 1, (2,), generator=g).tolist()
            top = min(max((cell // side) * self.cell + shift[0], 0), self.canvas - self.cell)
            left = min(max((cell % side) * self.cell + shift[1], 0), self.canvas - self.cell)
            out.append((index, c, top, left))
        return out

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 image ``[1, canvas, canvas]`` and its class map ``[canvas, canvas]`` (int64)."""
        if not 0 <= i < self.count:
            raise IndexError(f"scene {i} of {self.count}")
        image = torch.zeros(self.canvas, self.canvas, dtype=torch.uint8)
        mask = torch.zeros(self.canvas, self.canvas, dtype=torch.int64)
        cut = self.threshold * 255.0
        for index, c, top, left in self.layout(i):
            garment = self.images[index].reshape(self.cell, self.cell)
            window = (slice(top, top + self.cell), slice(left, left + self.cell))
            solid = garment.float() > cut
            image[window] = torch.where(solid, garment, torch.maximum(image[window], garment))
            mask[window] = torch.where(solid, c + 1, mask[window])
        faint = (image > 0) & (image.float() <= cut) & (mask == 0)
        return image[None], torch.where(faint, IGNORE_INDEX, mask)


def split_scenes(images: torch.Tensor, labels: torch.Tensor, split: str, count: int, canvas: int = 56,
                 garments: tuple[int, int] = (2, 4), jitter: int = 6, threshold: float = 0.1,
                 seed: int = 0) -> FashionMNISTScenes:
    """The scenes of one split (``train`` or ``test``, each drawn from its own Fashion-MNIST split's garments and
    its own stream of ``seed``): what ``eval.dense.dataset=scenes`` reads and ``sslkit data scenes`` writes."""
    return FashionMNISTScenes(images, labels, count, canvas, int(garments[0]), int(garments[1]), jitter, threshold,
                              int(seed) * 2 + (split == "test"))


def stored_class_map(mask: Any) -> Any:
    """A class map (classes from 0, :data:`IGNORE_INDEX` unscored) as ADE20K's 8-bit PNGs store it: class + 1, and 0
    for the ignored pixels (ADE20K's "other"), which :class:`SegmentationFolder`'s ``reduce_zero_label`` reads back
    as they were. uint8 numpy array."""
    import numpy as np

    mask = np.asarray(mask)
    if bool(((mask != IGNORE_INDEX) & (mask >= IGNORE_INDEX - 1)).any()):
        raise ValueError("a class above 253 does not fit an 8-bit class map beside the ignore label")
    return np.where(mask == IGNORE_INDEX, 0, mask.astype(np.int64) + 1).astype(np.uint8)


def write_segmentation_folder(dataset: Dataset, root: str | Path, split: str, meta: dict[str, Any] | None = None,
                              progress: Any = None) -> int:
    """Write ``dataset``'s (uint8 image, class map) pairs in ADE20K's layout under ``root``: lossless PNG images in
    ``images/<training|validation>/`` and class maps in ``annotations/...`` (same stem, ``%06d``) holding class + 1
    with :data:`IGNORE_INDEX` as 0, ADE20K's "other": :class:`SegmentationFolder` with ``reduce_zero_label`` (the
    default, mmsegmentation's and DINOv3's reading of ADE20K) reads back exactly the maps written. ``meta`` (the
    classes and how the set was made) goes to ``root/dataset.json``. Returns the pairs written."""
    from PIL import Image

    root = Path(root).expanduser()
    sub = ADE_SPLITS.get(split, split)
    images, annotations = root / "images" / sub, root / "annotations" / sub
    images.mkdir(parents=True, exist_ok=True)
    annotations.mkdir(parents=True, exist_ok=True)
    n = len(dataset)  # type: ignore[arg-type]
    for i in range(n):
        image, mask = dataset[i]
        pixels = image.numpy()
        Image.fromarray(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)).save(images / f"{i:06d}.png")
        Image.fromarray(stored_class_map(mask.numpy())).save(annotations / f"{i:06d}.png")
        if progress is not None:
            progress(1)
    if meta is not None:
        import json

        (root / FOLDER_META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return n


def folder_classes(root: str | Path) -> int | None:
    """The number of classes a segmentation folder's ``dataset.json`` states (one sslkit wrote), else None."""
    import json

    meta = Path(root).expanduser() / FOLDER_META
    if not meta.is_file():
        return None
    return int(json.loads(meta.read_text(encoding="utf-8")).get("num_classes") or 0) or None
