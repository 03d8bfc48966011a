"""Augmentations: registered builders of ``t(uint8 [C,H,W] image) -> list of float32 views``."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from sslkit.registry import TRANSFORMS, get, register_transform

__all__ = [
    "PIXEL_MAX",
    "USUAL_CROP_PCT",
    "EvalTransform",
    "Normalize",
    "SimCLRTransform",
    "Transform",
    "build_eval",
    "build_simclr",
    "build_transform",
    "centred_crop_box",
    "eval_resize",
    "random_resized_crop_box",
    "unit_float",
    "view_uniforms",
]

logger = logging.getLogger(__name__)

Transform = Callable[[torch.Tensor], list[torch.Tensor]]
"""What a transform builder returns: one image in, a list of normalised float32 views out."""

_GRAY_ROW = torch.tensor([[0.299, 0.587, 0.114]])  # ITU-R 601 luma weights, as PIL and torchvision use
_HUE_DIFFS = torch.tensor([[0.0, 1.0, -1.0], [-1.0, 0.0, 1.0], [1.0, -1.0, 0.0]])  # g-b, b-r, r-g
_HUE_PHASES = torch.tensor([0.0, 4.0, 2.0]).view(3, 1, 1)  # R, G, B phase in the HSV hexagon


#: The integer pixel types images come in and the value of their brightest pixel (8- and 16-bit files).
PIXEL_MAX = {torch.uint8: 255.0, torch.uint16: 65535.0}


def unit_float(images: torch.Tensor) -> torch.Tensor:
    """Images of any shape as a new float32 tensor in 0..1: 8-bit (uint8) divided by 255, 16-bit (uint16, TIFF and
    NumPy files of microscopes and satellites) by 65535, float ones copied as they are (taken to be in 0..1)."""
    top = PIXEL_MAX.get(images.dtype)
    if top is not None:
        return images.to(torch.float32).div_(top)
    if images.is_floating_point():
        return images.to(torch.float32, copy=True)
    raise TypeError(f"expected uint8, uint16 or float images, got {images.dtype}")


def _to_float(image: torch.Tensor) -> torch.Tensor:
    """An image ``[C,H,W]`` (:func:`unit_float`'s types) as a new float32 tensor in 0..1."""
    if image.ndim != 3:
        raise ValueError(f"expected an image tensor [C,H,W], got shape {tuple(image.shape)}")
    return unit_float(image)


class Normalize:
    """Per-channel ``(x - mean) / std`` with defaults of 0.5 (one value serves every channel), in place on a float
    image ``[C, H, W]`` the caller owns; tensors cached per channel count."""

    def __init__(self, mean: Sequence[float] | None, std: Sequence[float] | None) -> None:
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        if self.std is not None and any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _stats(self, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        if channels not in self._cache:
            out = []
            for name, vals in (("mean", self.mean), ("std", self.std)):
                vals = [0.5] if vals is None else vals
                if len(vals) == 1:
                    vals = vals * channels
                if len(vals) != channels:
                    raise ValueError(f"transform {name} has {len(vals)} values but the image has {channels} channel(s)")
                out.append(torch.tensor(vals, dtype=torch.float32).view(channels, 1, 1))
            self._cache[channels] = (out[0], 1.0 / out[1])
        return self._cache[channels]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean, inv_std = self._stats(x.shape[0])
        return x.sub_(mean).mul_(inv_std)

    def batch(self, x: torch.Tensor) -> torch.Tensor:
        """The same, in place, on a batch ``[B, C, H, W]``."""
        mean, inv_std = self._stats(x.shape[1])
        return x.sub_(mean).mul_(inv_std)

    def __getstate__(self) -> dict[str, Any]:  # the cache is rebuilt lazily after pickling
        return {**self.__dict__, "_cache": {}}


def random_resized_crop_box(
    u: Sequence[float], height: int, width: int, scale: Sequence[float], ratio: Sequence[float]
) -> tuple[int, int, int, int]:
    """Pick an Inception-style random crop ``(top, left, h, w)`` from uniforms ``u`` in [0, 1).

    Tries 10 times (4 uniforms each: area fraction in ``scale``, log aspect ratio in ``ratio``,
    vertical and horizontal position) to fit a box; falls back to the largest centred box whose
    aspect ratio lies in ``ratio``. ``u`` must hold at least 40 values.
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for k in range(10):
        a, r, y, x = u[4 * k : 4 * k + 4]
        target = area * (scale[0] + a * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + r * (log_hi - log_lo))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(y * (height - h + 1)), int(x * (width - w + 1)), h, w
    return centred_crop_box(height, width, ratio)


def centred_crop_box(height: int, width: int, ratio: Sequence[float]) -> tuple[int, int, int, int]:
    """The fallback of a random resized crop: the largest centred ``(top, left, h, w)`` with its aspect ratio
    in ``ratio``."""
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _gray(x: torch.Tensor) -> torch.Tensor:
    """Luma ``[1,H,W]`` of a float RGB image (other channel counts: the channel mean)."""
    if x.shape[0] != 3:
        return x.mean(0, keepdim=True)
    return torch.matmul(_GRAY_ROW, x.reshape(3, -1)).view(1, *x.shape[1:])


def _shift_hue(x: torch.Tensor, shift: float) -> torch.Tensor:
    """Rotate the HSV hue of a float RGB image in [0, 1] by ``shift`` turns (value and saturation kept).

    Written for few tensor ops, since on small images the per-op overhead dominates.
    """
    maxc, argmax = x.max(0)
    minc = x.amin(0)
    delta = maxc - minc
    # hue in sixths of a turn: (g-b)/delta if max is R, (b-r)/delta + 2 if G, (r-g)/delta + 4 if B
    diffs = torch.matmul(_HUE_DIFFS, x.reshape(3, -1)).view_as(x)
    h6 = diffs.gather(0, argmax.unsqueeze(0)).div_(delta.add(1e-12)).add_(argmax, alpha=2)
    # back to RGB through the hexagonal model: channel = min + delta * clamp(|k - 3| - 1, 0, 1),
    # k = (h6 + phase) mod 6 with phases 0, 4, 2 for R, G, B
    k = (h6 + (_HUE_PHASES + 6.0 * shift)).remainder_(6.0).sub_(3.0).abs_().sub_(1.0).clamp_(0.0, 1.0)
    return torch.addcmul(minc, delta, k)


def _brightness(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x.mul_(factor).clamp_(0.0, 1.0)


def _contrast(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend with the mean luma (a scalar), as torchvision's ``adjust_contrast``."""
    mean = float(torch.matmul(_GRAY_ROW, x.reshape(3, -1)).mean()) if x.shape[0] == 3 else float(x.mean())
    return x.mul_(factor).add_((1.0 - factor) * mean).clamp_(0.0, 1.0)


def _channel_contrast(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Each channel blended with its own mean by its own factor (``factors`` ``[C, 1, 1]``): a channel's contrast
    alone, where the channels are separate measurements (a microscope's stains, a satellite's bands)."""
    mean = x.mean(dim=(1, 2), keepdim=True)
    return x.mul_(factors).add_((1.0 - factors) * mean).clamp_(0.0, 1.0)


def _saturation(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend an RGB image with its luma image, as torchvision's ``adjust_saturation``."""
    return torch.lerp(_gray(x), x, factor).clamp_(0.0, 1.0)


@functools.lru_cache(maxsize=64)
def blur_taps(n: int, half: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Row and (reflect-padded) source-column indices of a ``2*half+1``-tap filter along ``n`` pixels, made on
    ``device`` (once per size: cached)."""
    rows = torch.arange(n, device=device).repeat_interleave(2 * half + 1)
    src = rows + torch.arange(-half, half + 1, device=device).repeat(n)
    for _ in range(2):  # reflect at both edges (twice covers kernels up to twice the image size)
        src = torch.where(src < 0, -src, src)
        src = torch.where(src > n - 1, 2 * (n - 1) - src, src)
    return rows, src.clamp_(0, n - 1)


def _blur_matrix(n: int, kernel: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` matrix applying the 1-D ``kernel`` along an axis of length ``n`` with reflect padding."""
    rows, cols = blur_taps(n, len(kernel) // 2)
    return torch.zeros(n, n).index_put_((rows, cols), kernel.repeat(n), accumulate=True)


def _gaussian_blur(x: torch.Tensor, kernel_size: int, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of a float ``[C,H,W]`` image with reflect padding (as two small matmuls)."""
    half = kernel_size // 2
    k1 = torch.arange(-half, half + 1, dtype=torch.float32).div_(sigma).square_().mul_(-0.5).exp_()
    k1 /= k1.sum()
    _, h, w = x.shape
    mh = _blur_matrix(h, k1)
    mw = mh if w == h else _blur_matrix(w, k1)
    return torch.matmul(torch.matmul(mh, x), mw.T)


def _blur_kernel(size: int) -> int:
    """The Gaussian blur's taps for crops of ``size``: an odd 10% of the side, at least 3 (SimCLR's)."""
    k = int(0.1 * size)
    return max(3, k + 1 if k % 2 == 0 else k)


def _resized(crop: torch.Tensor, s: int) -> torch.Tensor:
    """The float crop ``[C, h, w]`` resized to ``s x s`` (bilinear, antialiased when shrinking); itself when it is
    that size."""
    ch, cw = crop.shape[-2:]
    if (ch, cw) == (s, s):
        return crop
    antialias = ch > s or cw > s
    return F.interpolate(crop[None], size=(s, s), mode="bilinear", align_corners=False, antialias=antialias)[0]


def view_uniforms(channels: int, per_channel: bool) -> int:
    """Uniforms one SimCLR-style view of a ``channels``-channel image draws: 54 (40 for the crop, 14 after it), and
    with the per-channel jitter two per channel after them (the one rule of the workers' and the device's draws)."""
    return SimCLRTransform.N_UNIFORMS + (2 * channels if per_channel else 0)


class SimCLRTransform:
    """SimCLR-style views: random resized crop, flip, colour jitter, grayscale, blur, solarize.

    All randomness is drawn from torch's global CPU generator (one ``torch.rand`` call per view),
    so seeding that generator per sample makes the views reproducible.
    """

    # 40 for the crop; then flip, jitter (apply, 4 factors, 4 order keys), gray, blur (apply, sigma), solarize
    N_UNIFORMS = 40 + 14

    def __init__(
        self,
        image_size: int,
        num_views: int = 2,
        crop_scale: Sequence[float] = (0.08, 1.0),
        crop_ratio: Sequence[float] = (3 / 4, 4 / 3),
        hflip_p: float = 0.5,
        jitter_strength: float = 0.5,
        jitter_p: float = 0.8,
        grayscale_p: float = 0.2,
        blur_p: float = 0.0,
        blur_sigma: Sequence[float] = (0.1, 2.0),
        solarize_p: float = 0.0,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        jitter_per_channel: bool = False,
    ) -> None:
        """Configure the augmentation; see :func:`build_simclr` for the arguments."""
        if image_size < 1 or num_views < 1:
            raise ValueError(f"image_size and num_views must be >= 1, got {image_size}, {num_views}")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < lo <= hi <= 1, got {tuple(crop_scale)}")
        if not 0 < crop_ratio[0] <= crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < lo <= hi, got {tuple(crop_ratio)}")
        if jitter_strength < 0 or 0.2 * jitter_strength > 0.5:
            raise ValueError(f"jitter_strength must be in [0, 2.5], got {jitter_strength}")
        for name, p in (
            ("hflip_p", hflip_p),
            ("jitter_p", jitter_p),
            ("grayscale_p", grayscale_p),
            ("blur_p", blur_p),
            ("solarize_p", solarize_p),
        ):
            if not 0 <= p <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        self.image_size = int(image_size)
        self.num_views = int(num_views)
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.crop_ratio = (float(crop_ratio[0]), float(crop_ratio[1]))
        self.hflip_p = float(hflip_p)
        self.jitter_strength = float(jitter_strength)
        self.jitter_p = float(jitter_p) if jitter_strength > 0 else 0.0
        self.grayscale_p = float(grayscale_p)
        self.blur_p = float(blur_p)
        self.blur_sigma = (float(blur_sigma[0]), float(blur_sigma[1]))
        self.blur_kernel = _blur_kernel(self.image_size)
        self.solarize_p = float(solarize_p)
        self.jitter_per_channel = bool(jitter_per_channel)
        self.normalize = Normalize(mean, std)

    def uniforms(self, channels: int) -> int:
        """The uniforms one view of a ``channels``-channel image draws: 54 (40 for the crop, 14 after it), and with
        ``jitter_per_channel`` two per channel after them (its brightness and contrast factors)."""
        return view_uniforms(channels, self.jitter_per_channel)

    def _jitter(self, x: torch.Tensor, u: Sequence[float], per_channel: Sequence[float]) -> torch.Tensor:
        """Brightness, contrast, saturation, hue in the order ``u[4:8]`` draws; with ``per_channel`` (2 uniforms a
        channel) brightness and contrast take one factor per channel (:func:`build_simclr`)."""
        s = self.jitter_strength
        b, c, sat, hue = 0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s
        factors = (
            max(0.0, 1 - b) + u[0] * (1 + b - max(0.0, 1 - b)),
            max(0.0, 1 - c) + u[1] * (1 + c - max(0.0, 1 - c)),
            max(0.0, 1 - sat) + u[2] * (1 + sat - max(0.0, 1 - sat)),
            -hue + u[3] * 2 * hue,
        )
        channels = x.shape[0]
        if per_channel:
            draws = torch.tensor(per_channel[: 2 * channels], dtype=torch.float32).view(2, channels, 1, 1)
            bright = max(0.0, 1 - b) + draws[0] * (1 + b - max(0.0, 1 - b))
            contrast = max(0.0, 1 - c) + draws[1] * (1 + c - max(0.0, 1 - c))
        rgb = channels == 3
        for op in sorted(range(4), key=lambda i: u[4 + i]):  # random order of the four adjustments
            f = factors[op]
            if op == 0:
                x = x.mul_(bright).clamp_(0.0, 1.0) if per_channel else _brightness(x, f)
            elif op == 1:
                x = _channel_contrast(x, contrast) if per_channel else _contrast(x, f)
            elif op == 2 and rgb:
                x = _saturation(x, f)
            elif op == 3 and rgb and f != 0.0:
                x = _shift_hue(x, f)
        return x

    def view(self, image: torch.Tensor) -> torch.Tensor:
        """One augmented, normalised float32 view ``[C, image_size, image_size]`` of ``image``."""
        return self.view_pair(image)[0]

    def view_pair(self, image: torch.Tensor, teacher_size: int | None = None,
                  teacher_distortions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`view`, and with ``teacher_size`` the same crop box at ``teacher_size`` for a teacher that sees the
        crop at another resolution (DINOv3's Gram teacher crops, ``gram_teacher_crops_size``): flipped as the view;
        colour, blur and solarize applied too (the same draws, the blur's sigma scaled with the size) only with
        ``teacher_distortions`` (DINOv3's ``gram_teacher_no_distortions: true`` is ``False`` here). The teacher crop
        is resized from the image's crop box itself, not from the view, so it holds the detail the view lost."""
        u = torch.rand(self.uniforms(image.shape[0]), dtype=torch.float64).tolist()
        _, h, w = image.shape
        top, left, ch, cw = random_resized_crop_box(u, h, w, self.crop_scale, self.crop_ratio)
        crop = _to_float(image[:, top : top + ch, left : left + cw])
        teacher = None if teacher_size is None else _resized(crop, int(teacher_size)).clamp(0.0, 1.0)
        x = _resized(crop, self.image_size).clamp_(0.0, 1.0)
        view = self._distort(x, u[40:], self.blur_kernel, 1.0)
        if teacher is None:
            return view, None
        if teacher_distortions:
            return view, self._distort(teacher, u[40:], _blur_kernel(int(teacher_size)),
                                       int(teacher_size) / self.image_size)
        if u[40] < self.hflip_p:
            teacher = teacher.flip(-1)
        return view, self.normalize(teacher.contiguous())

    def _distort(self, x: torch.Tensor, u: Sequence[float], kernel: int, sigma_scale: float) -> torch.Tensor:
        """Flip, colour jitter, grayscale, blur (sigma x ``sigma_scale``, ``kernel`` taps) and solarize of the crop
        ``x`` in [0, 1] as the uniforms ``u`` say, then normalise."""
        if u[0] < self.hflip_p:
            x = x.flip(-1)
        if u[1] < self.jitter_p:
            x = self._jitter(x, u[2:10], u[14:])
        if x.shape[0] == 3 and u[10] < self.grayscale_p:
            x = _gray(x).expand(3, -1, -1).contiguous()
        if u[11] < self.blur_p:
            lo, hi = self.blur_sigma
            sigma = (lo + u[12] * (hi - lo)) * sigma_scale
            x = _gaussian_blur(x, kernel, sigma)
        if u[13] < self.solarize_p:
            x = torch.where(x >= 0.5, 1.0 - x, x)
        return self.normalize(x.contiguous())

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        """``num_views`` independently augmented views of ``image`` (uint8 ``[C,H,W]``)."""
        return [self.view(image) for _ in range(self.num_views)]

    def __repr__(self) -> str:
        return (
            f"SimCLRTransform(image_size={self.image_size}, num_views={self.num_views}, "
            f"crop_scale={self.crop_scale}, hflip_p={self.hflip_p}, jitter_strength={self.jitter_strength}, "
            f"grayscale_p={self.grayscale_p}, blur_p={self.blur_p}, solarize_p={self.solarize_p})"
        )


#: The share of the resized image the usual evaluation crop keeps (224 of 256, timm's ``crop_pct`` default).
USUAL_CROP_PCT = 0.875
_WARNED: set[tuple[int, int]] = set()


def eval_resize(image_size: int, resize: int | None = None, crop_pct: float | None = None) -> int | None:
    """The shorter side an evaluation image is resized to before its centre crop of ``image_size``: ``resize`` when
    given, else ``floor(image_size / crop_pct)`` (timm's rule: 256 for 224 at 0.875, 73 for 64), else None (no resize
    but an upscale of images smaller than the crop). Logs a warning, once per size pair, when an explicit ``resize``
    makes the crop keep less of the image than the usual 224 of 256."""
    if image_size < 1 or (resize is not None and resize < 1):
        raise ValueError(f"image_size and resize must be >= 1, got {image_size}, {resize}")
    if resize is not None:
        if image_size / resize < USUAL_CROP_PCT - 1e-6 and (image_size, resize) not in _WARNED:
            _WARNED.add((image_size, resize))
            logger.warning("evaluation crop: %d px out of images resized to %d keeps %.0f%% of their side (the "
                           "usual is 224 of 256, 88%%): the evaluation sees less of each image than training does. "
                           "Set data.eval_transform.resize=null to follow data.eval_transform.crop_pct (0.875), or "
                           "a resize near image_size / 0.875 = %d", image_size, resize, 100 * image_size / resize,
                           math.floor(image_size / USUAL_CROP_PCT))
        return int(resize)
    if crop_pct is not None:
        if not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        return math.floor(image_size / crop_pct + 1e-9)
    return None


class EvalTransform:
    """Deterministic single view: optional shorter-side resize, centre crop, normalise."""

    def __init__(
        self,
        image_size: int,
        resize: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        crop_pct: float | None = None,
    ) -> None:
        """Configure; see :func:`build_eval`."""
        self.resize = eval_resize(image_size, resize, crop_pct)
        self.image_size = int(image_size)
        self.normalize = Normalize(mean, std)

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        """A list holding the one normalised float32 view ``[C, image_size, image_size]``."""
        return [self.batch(image[None])[0]]

    def batch(self, images: torch.Tensor) -> torch.Tensor:
        """The views ``[B, C, image_size, image_size]`` of images ``[B, C, H, W]`` of one size (uint8, uint16, or
        float in 0..1), each exactly what :meth:`__call__` gives it, in a few batched operations."""
        if images.ndim != 4:
            raise ValueError(f"expected images [B,C,H,W], got shape {tuple(images.shape)}")
        x = unit_float(images)
        _, _, h, w = x.shape
        short = self.resize if self.resize is not None else max(self.image_size, min(h, w))
        if min(h, w) != short:
            nh, nw = (short, max(1, round(w * short / h))) if h <= w else (max(1, round(h * short / w)), short)
            down = nh < h or nw < w
            x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=down).clamp_(0.0, 1.0)
        s = self.image_size
        _, _, h, w = x.shape
        if h < s or w < s:  # only when an explicit resize is smaller than the crop
            x = F.interpolate(x, size=(max(h, s), max(w, s)), mode="bilinear", align_corners=False)
            _, _, h, w = x.shape
        top, left = (h - s) // 2, (w - s) // 2
        x = x[:, :, top : top + s, left : left + s].contiguous()
        return self.normalize.batch(x)

    def __repr__(self) -> str:
        return f"EvalTransform(image_size={self.image_size}, resize={self.resize})"


@register_transform("simclr")
def build_simclr(
    image_size: int,
    num_views: int = 2,
    crop_scale: Sequence[float] = (0.08, 1.0),
    hflip_p: float = 0.5,
    jitter_strength: float = 0.5,
    grayscale_p: float = 0.2,
    blur_p: float = 0.0,
    solarize_p: float = 0.0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    crop_ratio: Sequence[float] = (3 / 4, 4 / 3),
    jitter_p: float = 0.8,
    blur_sigma: Sequence[float] = (0.1, 2.0),
    jitter_per_channel: bool = False,
) -> SimCLRTransform:
    """SimCLR augmentation producing ``num_views`` views of ``image_size`` x ``image_size``.

    Random resized crop (area fraction in ``crop_scale``), horizontal flip with ``hflip_p``,
    colour jitter (brightness/contrast/saturation 0.8s, hue 0.2s with s = ``jitter_strength``,
    applied with p=0.8 in random order; 1-channel images get brightness and contrast only),
    grayscale with ``grayscale_p`` (RGB only), Gaussian blur with ``blur_p`` (kernel ~10% of the
    image size, sigma in (0.1, 2.0)), solarize with ``solarize_p``, then normalise with ``mean``
    and ``std`` (None: 0.5 per channel). ``crop_ratio`` bounds the crop's aspect ratio,
    ``jitter_p`` is the probability of the colour jitter, ``blur_sigma`` the blur's sigma range.

    ``jitter_per_channel``: brightness and contrast draw one factor per channel (in the same ranges; contrast blends
    each channel with its own mean, not with the luma's), for images whose channels are separate measurements
    (fluorescence stains, spectral bands), where one factor for all keeps their ratios fixed. Off: torchvision's
    ``ColorJitter`` (one factor; contrast towards the mean luma). Saturation and hue stay RGB-only either way. It
    draws 2 uniforms a channel more per view, so it changes every later draw of a seeded run.
    """
    return SimCLRTransform(
        image_size,
        num_views=num_views,
        crop_scale=crop_scale,
        hflip_p=hflip_p,
        jitter_strength=jitter_strength,
        grayscale_p=grayscale_p,
        blur_p=blur_p,
        solarize_p=solarize_p,
        mean=mean,
        std=std,
        crop_ratio=crop_ratio,
        jitter_p=jitter_p,
        blur_sigma=blur_sigma,
        jitter_per_channel=jitter_per_channel,
    )


class MultiCropTransform:
    """Several groups of crops of one image, in order: e.g. 2 global crops then N local ones.

    Each group is a :class:`SimCLRTransform` (its own size, scale and probabilities); the
    views come back as one list, the global crops first (SwAV, DINO). With ``teacher_size``, each of the first
    ``teacher_groups`` groups (the global crops) also gives its crop at ``teacher_size``
    (:meth:`SimCLRTransform.view_pair`) and the transform returns ``{"views": [...], "teacher_views": [...]}``.
    """

    def __init__(self, groups: Sequence[SimCLRTransform], teacher_size: int | None = None,
                 teacher_distortions: bool = False, teacher_groups: int = 0) -> None:
        """Concatenate the views of ``groups``."""
        if teacher_size is not None and teacher_size < 1:
            raise ValueError(f"teacher_size must be >= 1 (or null: no teacher crops), got {teacher_size}")
        self.groups = list(groups)
        self.teacher_size = None if teacher_size is None else int(teacher_size)
        self.teacher_distortions = bool(teacher_distortions)
        self.teacher_groups = int(teacher_groups)

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor] | dict[str, list[torch.Tensor]]:
        """Every group's views of ``image``, group after group (and the teacher's crops, with ``teacher_size``)."""
        if self.teacher_size is None:
            return [view for group in self.groups for view in group(image)]
        views, teacher = [], []
        for i, group in enumerate(self.groups):
            if i >= self.teacher_groups:
                views += group(image)
                continue
            for _ in range(group.num_views):
                view, crop = group.view_pair(image, self.teacher_size, self.teacher_distortions)
                views.append(view)
                teacher.append(crop)
        return {"views": views, "teacher_views": teacher}

    def __repr__(self) -> str:
        extra = f", teacher_size={self.teacher_size}" if self.teacher_size is not None else ""
        return f"MultiCropTransform({self.groups}{extra})"


@register_transform("multicrop")
def build_multicrop(
    image_size: int,
    small_size: int,
    num_large: int = 2,
    num_small: int = 6,
    crop_scale: Sequence[float] = (0.14, 1.0),
    small_scale: Sequence[float] = (0.05, 0.14),
    hflip_p: float = 0.5,
    jitter_strength: float = 0.5,
    grayscale_p: float = 0.2,
    blur_p: float | Sequence[float] = 0.0,
    solarize_p: float | Sequence[float] = 0.0,
    small_blur_p: float = 0.0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    teacher_size: int | None = None,
    teacher_distortions: bool = False,
    jitter_per_channel: bool = False,
) -> MultiCropTransform:
    """Multi-crop (SwAV, Caron et al. 2020; DINO): ``num_large`` crops of ``image_size`` with area
    in ``crop_scale``, then ``num_small`` crops of ``small_size`` with area in ``small_scale``.

    ImageNet: 2 x 224 (0.14-1) + 6 x 96 (0.05-0.14). ``blur_p`` and ``solarize_p`` may be lists,
    one value per large crop, for the asymmetric augmentation of BYOL and DINO (blur 1.0 / 0.1,
    solarize 0.0 / 0.2); the small crops use ``small_blur_p`` and no solarize. ``teacher_size``: each large crop
    also at this size, for a teacher that sees the global crops at another resolution (DINOv3's Gram teacher:
    ``gram.teacher_size``), distorted as the crop only with ``teacher_distortions``. ``jitter_per_channel``:
    :func:`build_simclr`'s, for every crop.
    """
    def per_large(value: float | Sequence[float], name: str) -> list[float]:
        values = [float(value)] * num_large if isinstance(value, int | float) else [float(v) for v in value]
        if len(values) != num_large:
            raise ValueError(f"{name} has {len(values)} values for {num_large} large crops")
        return values

    common = dict(hflip_p=hflip_p, jitter_strength=jitter_strength, grayscale_p=grayscale_p, mean=mean, std=std,
                  jitter_per_channel=jitter_per_channel)
    blurs, sols = per_large(blur_p, "blur_p"), per_large(solarize_p, "solarize_p")
    groups = [SimCLRTransform(image_size, num_views=1, crop_scale=crop_scale, blur_p=b, solarize_p=z, **common)
              for b, z in zip(blurs, sols)]
    if num_small > 0:
        groups.append(SimCLRTransform(small_size, num_views=num_small, crop_scale=small_scale,
                                      blur_p=small_blur_p, **common))
    return MultiCropTransform(groups, teacher_size, teacher_distortions, teacher_groups=num_large)


@register_transform("eval")
def build_eval(
    image_size: int,
    resize: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    crop_pct: float | None = None,
) -> EvalTransform:
    """Evaluation transform: resize the shorter side (to ``resize``, or to ``image_size / crop_pct`` so that the
    resize follows the crop size: :func:`eval_resize`), centre-crop ``image_size``.

    With neither, an image whose shorter side is below ``image_size`` is upscaled to it
    rather than padded. Returns a list with one normalised view.
    """
    return EvalTransform(image_size, resize=resize, mean=mean, std=std, crop_pct=crop_pct)


def build_transform(name: str, where: str = "data.train.transform.name", **kwargs: Any) -> Transform:
    """Build the registered transform ``name`` with ``kwargs``; ``where`` names the config key for errors."""
    builder: Callable[..., Transform] = get(TRANSFORMS, name, where=where)
    return builder(**kwargs)
