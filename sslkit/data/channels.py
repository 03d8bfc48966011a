"""An image's channel count and how it becomes the run's: counted from the data (``channels: auto``), converted by
PIL's rules where the counts differ, and said once per run when they do."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from sslkit.data.errors import DataSourceError, UnreadableSampleError
from sslkit.data.notices import say_once

__all__ = ["AUTO", "array_channels", "channel_setting", "convert_channels", "first_readable", "jpeg_channels",
           "pil_channels", "resolve_channels", "say_conversion"]

logger = logging.getLogger("sslkit.data")

T = TypeVar("T")

#: ``data.<split>.kwargs.channels: auto``: the count read from the data (the first readable image).
AUTO = "auto"

#: ITU-R 601-2 luma, as PIL's ``convert("L")``: what a 3-channel array becomes for one-channel data.
_LUMA = np.array([0.299, 0.587, 0.114])
_LUMA_FIXED = np.array([19595, 38470, 7471], dtype=np.int64)  # the same weights in 16-bit fixed point, PIL's


def channel_setting(channels: Any) -> int | str:
    """A source's ``channels`` argument checked: :data:`AUTO`, or a whole number of at least 1 (as an int)."""
    if channels == AUTO:
        return AUTO
    if isinstance(channels, bool) or not isinstance(channels, int | str) or not str(channels).isdigit() \
            or int(channels) < 1:
        raise DataSourceError(f"channels must be 1 or more, or auto (read from the data), got {channels!r}")
    return int(channels)


def array_channels(arr: np.ndarray) -> int:
    """The channels of an image held as an array: 1 for ``[H, W]``; for ``[H, W, C]`` or ``[C, H, W]`` the shorter
    end (the last on a tie: NumPy's and tifffile's ``[H, W, C]``), so an image is taken to be larger on both sides
    than its channel count (a 13-band ``[13, 6, 5]`` array reads as 5 bands of 13 x 6: set the count for such)."""
    if arr.ndim == 2:
        return 1
    if arr.ndim != 3:
        raise UnreadableSampleError(f"an array of shape {arr.shape}; an image is [H, W], [H, W, C] or [C, H, W]")
    return int(min(arr.shape[0], arr.shape[-1]))


def pil_channels(img: Any, alpha: bool = False) -> int:
    """The channels of a PIL image: its bands (a palette's entries are RGB; CMYK, YCbCr and LAB are read as RGB),
    an alpha band counted only with ``alpha`` (a TIFF's fourth band is as often a measurement as transparency; a
    PNG's is transparency)."""
    mode = img.mode
    if mode in ("P", "PA", "CMYK", "YCbCr", "LAB", "HSV"):
        bands = 3 + (mode == "PA")
    else:
        bands = len(img.getbands())
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La")
    return bands - (has_alpha and not alpha)


#: JPEG's start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic coded).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_channels(data: bytes) -> int | None:
    """The component count of a JPEG's frame header (1: grey, 3: YCbCr, 4: CMYK), read from its markers without
    decoding; None when no frame header is found (not a JPEG, or cut short)."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill bytes
            i += 1
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker in _SOF:
            return data[i + 9] if i + 9 < n else None
        i += 2 + length
    return None


def resolve_channels(channels: Any, count: Callable[[int], int], size: int, where: str, probe: int = 32) -> int:
    """``channels`` as a count: itself when given; for :data:`AUTO` ``count(i)`` of the first sample that can be
    read (:func:`first_readable` over ``probe`` of the ``size`` samples), logged with where it came from."""
    setting = channel_setting(channels)
    if setting != AUTO:
        return int(setting)
    i, found = first_readable(count, size, where, probe)
    logger.info("%s: %d channel(s), read from its image %d (channels: auto); set data.<split>.kwargs.channels to "
                "read another count", where, found, i)
    return int(found)


def first_readable(read: Callable[[int], T], size: int, where: str, probe: int = 32) -> tuple[int, T]:
    """``(i, read(i))`` for the first sample ``i``, among up to ``probe`` spread evenly over the ``size`` samples (all
    of them if there are fewer), that ``read`` does not find unreadable (:class:`UnreadableSampleError`). Raises
    :func:`_nothing_readable`'s error naming ``where`` when none of them can be read."""
    k = min(size, probe)
    errors: list[str] = []
    for i in sorted({j * size // k for j in range(k)}) if k else []:
        try:
            return i, read(i)
        except UnreadableSampleError as e:
            errors.append(str(e))
    raise _nothing_readable(where, size, k, errors)


def _nothing_readable(where: str, size: int, tried: int, errors: list[str]) -> DataSourceError:
    """The error of a source none of whose ``tried`` images (spread over its ``size``) could be read: ``errors``,
    the first three of them shown."""
    what = f"all {size} image files" if tried == size else f"the {tried} image files tried (spread over all {size})"
    examples = "".join(f"\n  - {e}" for e in errors[:3])
    return DataSourceError(f"no readable image in {where}: {what} are corrupt, truncated or not images, e.g.:"
                           f"{examples}\nSingle unreadable files are skipped and counted, but there is nothing to "
                           "train on here: check or re-copy the files.")


def convert_channels(arr: np.ndarray, channels: int, where: str, axis: int = 0) -> np.ndarray:
    """``arr`` with ``channels`` entries on its channel ``axis``, by PIL's conversions: one channel for 3 is
    repeated, 3 or 4 (RGBA) for one become their ITU-R 601-2 luma (integers rounded as ``convert("L")``), 4 for 3 lose
    alpha; the array itself when it has them already. Raises :class:`UnreadableSampleError` naming ``where`` for
    any other pair."""
    c = arr.shape[axis]
    if c == channels:
        return arr
    if c == 1 and channels == 3:
        return np.repeat(arr, 3, axis=axis)
    if c in (3, 4) and channels == 1:
        rgb = np.moveaxis(arr, axis, -1)[..., :3]
        if arr.dtype.kind == "u":  # PIL's fixed point (Convert.c's L24): the same bytes as convert("L")
            luma = (rgb.astype(np.int64) @ _LUMA_FIXED + 0x8000) >> 16
        else:  # float pixels in 0..1 stay unrounded
            luma = rgb.astype(np.float64) @ _LUMA
        return np.expand_dims(luma, axis).astype(arr.dtype)
    if c == 4 and channels == 3:
        return np.take(arr, [0, 1, 2], axis=axis)
    raise UnreadableSampleError(f"{where}: {c} channels, and the data has {channels} (data.<split>.kwargs.channels)",
                                where)


def say_conversion(where: str, native: int, channels: int) -> None:
    """Warn, once per run (:func:`~sslkit.data.notices.say_once`; once per process outside a run) for each pair of
    counts, that the image ``where`` of ``native`` channels is converted to the run's ``channels`` (PIL's rules:
    grey repeated, RGB to luma, alpha or other bands dropped): a count that differs is never taken in silence (a
    4-band TIFF read as RGBA and cut to RGB was). The run's report repeats it."""
    if native == channels:
        return
    how = {(1, 3): "its grey repeated", (3, 1): "its luma", (4, 3): "its fourth band dropped (as alpha)",
           (4, 1): "the luma of its first three bands", (2, 1): "its second band dropped (as alpha)",
           (2, 3): "its grey repeated, its second band dropped"}.get((native, channels), "converted")
    say_once(f"channels-{native}-to-{channels}",
             f"{where} has {native} channel(s) and the run reads {channels}: {how}. Set data.<split>.kwargs.channels="
             f"{native} (and a trunk of that many, model.pretrained_channels for a released one) to read all of them, "
             f"or give images of {channels} channel(s); said once for every such pair of counts")
