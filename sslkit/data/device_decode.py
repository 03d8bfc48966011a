"""Train batches as read for ``data.augment_on=device``: images of many sizes and JPEG bytes, decoded on the device.

Under ``data.augment_on=device`` the loader workers do not augment. A batch whose images all have one
size is stacked as usual. Otherwise (a folder of photos) :func:`collate_raw` packs the decoded images'
pixels into one buffer (one pinned copy to the device) and keeps, with ``data.decode_on=device``, the
JPEG files' bytes as read: :class:`DeviceDecoder` decodes them on the training device in one batched
call (nvJPEG on CUDA through ``torchvision.io.decode_jpeg``; libjpeg on the CPU). What the batched call
refuses is decoded one by one, then on the CPU (CMYK and other JPEGs the GPU decoder does not take); a
file nothing can decode is replaced by another image of the batch and marked in ``data_valid``, as the
workers replace an unreadable file, with one warning per file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sslkit.data.device_augment import PackedImages
from sslkit.data.sources import DataSourceError

__all__ = ["DeviceDecoder", "RawImages", "collate_raw"]

logger = logging.getLogger("sslkit.data")

@dataclass
class RawImages:
    """One view of a train batch as the workers read it: decoded images (uint8 ``[C, H, W]``, many sizes)
    packed into one buffer, and JPEG files as bytes (1-D uint8, on the host: the decoder reads them there)."""

    #: The decoded images' pixels, one after another.
    pixels: torch.Tensor
    #: ``(C, H, W)`` of each decoded image, in batch order of the decoded ones.
    shapes: list[tuple[int, int, int]]
    #: Position in the batch of each decoded image, and of each JPEG.
    decoded_at: list[int]
    encoded_at: list[int] = field(default_factory=list)
    #: The JPEG files' bytes, in the order of ``encoded_at``.
    encoded: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        """Number of images in the batch."""
        return len(self.decoded_at) + len(self.encoded_at)

    def pin_memory(self) -> RawImages:
        """Pinned pixels (the DataLoader's pin thread calls this), so their copy to the GPU is asynchronous."""
        return RawImages(self.pixels.pin_memory(), self.shapes, self.decoded_at, self.encoded_at, self.encoded)


def collate_raw(images: Sequence[torch.Tensor]) -> torch.Tensor | RawImages:
    """One view of a batch under ``data.augment_on=device``: a stack if the tensors have one shape (images of one
    size, the uniforms of the augmentation), else :class:`RawImages` (1-D tensors are JPEG bytes)."""
    if all(t.dim() != 1 for t in images) and len({tuple(t.shape) for t in images}) == 1:
        return torch.stack(list(images))
    decoded_at = [i for i, t in enumerate(images) if t.dim() == 3]
    encoded_at = [i for i, t in enumerate(images) if t.dim() != 3]
    pixels = torch.cat([images[i].reshape(-1) for i in decoded_at]) if decoded_at else torch.empty(0, dtype=torch.uint8)
    return RawImages(pixels, [tuple(images[i].shape) for i in decoded_at], decoded_at, encoded_at,
                     [images[i] for i in encoded_at])


class DeviceDecoder:
    """Turns a :class:`RawImages` batch into images on the training device: the packed pixels in one copy,
    the JPEGs decoded in one batched call; a file that cannot be decoded is replaced by another image of
    the batch, marked invalid in the sample's ``data_valid`` and warned about once.

    ``channels`` is the source's (1 decodes JPEGs to grayscale, 3 to RGB); ``describe(index)`` names a
    sample (its file) in the warning.
    """

    def __init__(self, channels: int, describe: Callable[[int], str] = lambda i: f"sample {i}") -> None:
        """Decode to ``channels`` channels; ``describe`` names a sample by its dataset index."""
        self.channels = channels
        self.describe = describe
        self._warned: set[int] = set()

    def decode(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """JPEG bytes to uint8 ``[C, H, W]`` on ``device``: one batched call, then one by one and on the CPU
        for what it refuses; None for a file nothing decodes."""
        from torchvision.io import ImageReadMode, decode_image, decode_jpeg  # (imported when JPEGs are decoded)

        if not data:
            return []
        mode = ImageReadMode.GRAY if self.channels == 1 else ImageReadMode.RGB
        try:
            return list(decode_jpeg(data, mode=mode, device=device))
        except RuntimeError:
            pass
        out: list[torch.Tensor | None] = []
        for d in data:
            try:
                out.append(decode_jpeg(d, mode=mode, device=device))
                continue
            except RuntimeError:
                pass
            try:  # what the device decoder does not take (CMYK, lossless, ...) the CPU may
                out.append(decode_image(d, mode=mode).to(device))
            except RuntimeError:
                out.append(None)
        return out

    def __call__(self, raw: RawImages, sample: dict[str, Any], device: torch.device) -> PackedImages:
        """The batch's images on ``device``, packed (:class:`PackedImages`) in batch order."""
        pixels = raw.pixels.to(device, non_blocking=True) if raw.decoded_at else raw.pixels
        if not raw.encoded_at:  # all decoded by the workers: already packed in batch order, no copy to repeat
            return PackedImages(pixels, raw.shapes)
        images: list[torch.Tensor | None] = [None] * len(raw)
        if raw.decoded_at:
            offset = 0
            for at, shape in zip(raw.decoded_at, raw.shapes, strict=True):
                size = shape[0] * shape[1] * shape[2]
                images[at] = pixels[offset : offset + size].view(shape)
                offset += size
        for at, image in zip(raw.encoded_at, self.decode(raw.encoded, device), strict=True):
            images[at] = image
        bad = [i for i, image in enumerate(images) if image is None]
        if bad:
            self._replace(images, bad, sample)
        return PackedImages.of(images)  # type: ignore[arg-type]

    def _replace(self, images: list[torch.Tensor | None], bad: list[int], sample: dict[str, Any]) -> None:
        """Put another image of the batch in place of each undecodable one and mark it in ``data_valid``."""
        good = next((image for image in images if image is not None), None)
        index = sample.get("data_idx")
        names = [int(index[i]) for i in bad] if isinstance(index, torch.Tensor) else bad  # error path only
        if good is None:
            raise DataSourceError(
                f"no image of a batch of {len(images)} could be decoded (e.g. {self.describe(names[0])}): the "
                "files are corrupt, truncated or not images; check or re-copy them, or use data.decode_on=workers "
                "to skip them one by one"
            )
        for i, name in zip(bad, names, strict=True):
            images[i] = good
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("skipping undecodable image (%s); using another image of its batch instead",
                               self.describe(name))
        valid = sample.get("data_valid")
        if isinstance(valid, torch.Tensor):
            valid[bad] = False
