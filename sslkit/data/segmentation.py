"""Segmentation sets for the dense probe: images with per-pixel class maps (an ADE20K-layout folder, or
Fashion-MNIST's images with each object pixel labelled by the image's class), and their joint resize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from sslkit.data.transforms import Normalize

__all__ = ["IGNORE_INDEX", "IMAGE_SUFFIXES", "FashionMNISTSegmentation", "SegmentationFolder", "SegmentationTransform",
           "TransformedSegmentation"]

#: The label of pixels no class is scored on (ADE20K's "other" after ``reduce_zero_label``, mmseg's convention).
IGNORE_INDEX = 255
#: The image files a segmentation folder reads.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
#: A folder split's sub-folder name in the ADE20K layout.
ADE_SPLITS = {"train": "training", "test": "validation"}


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

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 RGB image ``[3, H, W]`` and its class map ``[H, W]`` (int64, :data:`IGNORE_INDEX` where unscored)."""
        import numpy as np
        from PIL import Image

        image_path, mask_path = self.pairs[i]
        with Image.open(image_path) as im:
            image = torch.from_numpy(np.asarray(im.convert("RGB"))).permute(2, 0, 1).contiguous()
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
