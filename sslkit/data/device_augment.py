"""SimCLR-style augmentation of a whole batch on its device: per-sample random parameters, a few batched kernels.

The augmentation of ``data.augment_on=device`` (docs/data.md). It computes what
:class:`sslkit.data.transforms.SimCLRTransform` computes for one image, for a batch of images at once, on
the batch's device (CPU or CUDA), with no Python loop over images and no host-device sync. It takes the
uniforms in the per-image transform's layout (54 per view: 40 for the crop, then flip, jitter, grayscale,
blur, solarize; 2 a channel more with ``jitter_per_channel``): each sample's, drawn in the loader workers
(:class:`ReadForDevice`, for :meth:`DeviceAugment.apply`), or drawn for the batch from a generator
(``__call__``). Given the same uniforms both pipelines draw the same crop boxes, flips, jitter factors and
order, grayscale, blur sigmas and solarisation. The crop and resize is one ``torchvision.ops.roi_align`` over all boxes
(bilinear, averaging several samples per output pixel where it shrinks a crop), which differs from the per-image
antialiased ``F.interpolate`` in the last digits of a resized crop (tests/data/test_device_augment.py
measures how much); every other operation gives the per-image result up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from sslkit.data.transforms import MultiCropTransform, SimCLRTransform, blur_taps, unit_float, view_uniforms

__all__ = [
    "UNIFORMS_PER_VIEW", "DeviceAugment", "DeviceSimCLRAugment", "Images", "PackedImages", "ReadForDevice",
    "channels_of", "crop_and_resize", "crop_boxes", "device_augment_for", "pack",
]

#: Uniforms one view consumes, in :class:`SimCLRTransform`'s layout.
UNIFORMS_PER_VIEW = SimCLRTransform.N_UNIFORMS
_GRAY = (0.299, 0.587, 0.114)


def _centred_boxes(height: torch.Tensor, width: torch.Tensor, ratio: Sequence[float]) -> list[torch.Tensor]:
    """:func:`sslkit.data.transforms.centred_crop_box` for per-sample sizes (float64 tensors): top, left, h, w."""
    in_ratio = width / height
    narrow, wide = in_ratio < ratio[0], in_ratio > ratio[1]
    w = torch.where(wide, torch.round(height * ratio[1]), width)
    h = torch.where(narrow, torch.round(width / ratio[0]), height)
    return [torch.div(height - h, 2, rounding_mode="floor"), torch.div(width - w, 2, rounding_mode="floor"), h, w]


def crop_boxes(u: torch.Tensor, height: int | torch.Tensor, width: int | torch.Tensor, scale: Sequence[float],
               ratio: Sequence[float]) -> torch.Tensor:
    """Inception-style random crop boxes ``[N, 4]`` (top, left, h, w) from uniforms ``u`` [N, >= 40].

    :func:`sslkit.data.transforms.random_resized_crop_box` for every row at once: 10 attempts per row
    (area fraction, log aspect ratio, vertical and horizontal position), the first that fits wins, else the
    largest centred box whose aspect ratio lies in ``ratio``. Same uniforms, same boxes. ``height`` and
    ``width`` are one image size, or per-row sizes ``[N]`` (images of many sizes).
    """
    u = u[:, :40].to(torch.float64).view(-1, 10, 4)
    if isinstance(height, int) and isinstance(width, int):  # one size: Python numbers, made on the device
        size = [torch.full((u.shape[0],), float(v), dtype=torch.float64, device=u.device) for v in (height, width)]
    else:
        size = [torch.as_tensor(v).to(device=u.device, dtype=torch.float64).expand(u.shape[0])
                for v in (height, width)]
    hh, ww = (v.unsqueeze(1) for v in size)
    area = hh * ww
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = area * (scale[0] + u[..., 0] * (scale[1] - scale[0]))
    aspect = torch.exp(log_lo + u[..., 1] * (log_hi - log_lo))
    # Python's round() is round-half-even, as torch.round
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (w <= ww) & (h > 0) & (h <= hh)
    first = torch.argmax(fits.to(torch.int8), dim=1, keepdim=True)  # the first attempt that fits (0 if none)
    any_fit = fits.any(dim=1)
    pick = lambda t: t.gather(1, first).squeeze(1)
    h1, w1 = pick(h), pick(w)
    top = torch.floor(pick(u[..., 2]) * (size[0] - h1 + 1))
    left = torch.floor(pick(u[..., 3]) * (size[1] - w1 + 1))
    fallback = _centred_boxes(size[0], size[1], ratio)
    boxes = [torch.where(any_fit, value, other) for value, other in zip((top, left, h1, w1), fallback, strict=True)]
    return torch.stack(boxes, dim=1).to(torch.int64)


class PackedImages:
    """Images of many sizes packed one after another in one flat buffer on their device (``[C, H_i, W_i]``
    each, in order), with their sizes on the host (for the chunking, no sync) and on the device (for the
    gather). The device augmentation takes it in place of a list, so a batch is packed once for all views."""

    def __init__(self, flat: torch.Tensor, shapes: Sequence[tuple[int, int, int]]) -> None:
        """``flat``: the pixels of every image, concatenated; ``shapes``: each image's ``(C, H, W)``."""
        self.flat = flat
        self.shapes = [tuple(int(v) for v in s) for s in shapes]
        channels = {s[0] for s in self.shapes}
        if len(channels) != 1:
            raise ValueError(f"the images of a batch have different channel counts: {sorted(channels)}")
        self.channels = channels.pop()
        sizes = torch.tensor([s[1:] for s in self.shapes], dtype=torch.int64)
        starts = torch.tensor([0] + [math.prod(s) for s in self.shapes[:-1]], dtype=torch.int64).cumsum(0)
        host = torch.cat([sizes, starts.view(-1, 1)], 1)
        cuda = flat.device.type == "cuda"
        moved = host.pin_memory().to(flat.device, non_blocking=True) if cuda else host.to(flat.device)
        self.hw, self.start = moved[:, :2], moved[:, 2]

    @classmethod
    def of(cls, images: Sequence[torch.Tensor]) -> PackedImages:
        """Pack a list of ``[C, H_i, W_i]`` images (one copy)."""
        return cls(torch.cat([t.reshape(-1) for t in images]), [tuple(t.shape) for t in images])

    def __len__(self) -> int:
        """Number of images."""
        return len(self.shapes)

    @property
    def device(self) -> torch.device:
        """Where the pixels are."""
        return self.flat.device

    def stacked(self) -> torch.Tensor | None:
        """The batch as one ``[N, C, H, W]`` tensor (a view of the buffer) if all images have one size."""
        if len(set(self.shapes)) != 1:
            return None
        return self.flat.view(len(self.shapes), *self.shapes[0])

    def padded(self, first: int, last: int) -> torch.Tensor:
        """Images ``first:last`` as one ``[n, C, H, W]`` batch at their largest height and width, each padded by
        repeating its last row and column: a bilinear sample at an image's edge then reads the edge pixel, as it
        does in an unpadded image."""
        height = max(s[1] for s in self.shapes[first:last])
        width = max(s[2] for s in self.shapes[first:last])
        device = self.flat.device
        hw, start = self.hw[first:last], self.start[first:last]
        h, w = hw[:, 0].view(-1, 1, 1, 1), hw[:, 1].view(-1, 1, 1, 1)
        y = torch.minimum(torch.arange(height, device=device).view(1, 1, -1, 1), h - 1)
        x = torch.minimum(torch.arange(width, device=device).view(1, 1, 1, -1), w - 1)
        c = torch.arange(self.channels, device=device).view(1, -1, 1, 1)
        return self.flat[start.view(-1, 1, 1, 1) + (c * h + y) * w + x]

    def chunks(self, budget: int) -> list[tuple[int, int]]:
        """Ranges of consecutive images whose padded batch has at most ``budget`` elements (an image larger than
        that alone), so that one large photo does not pad every other image of the batch to its size."""
        ranges, first = [], 0
        while first < len(self.shapes):
            last, height, width = first + 1, self.shapes[first][1], self.shapes[first][2]
            while last < len(self.shapes):
                h, w = max(height, self.shapes[last][1]), max(width, self.shapes[last][2])
                if (last - first + 1) * self.channels * h * w > budget:
                    break
                last, height, width = last + 1, h, w
            ranges.append((first, last))
            first = last
        return ranges


#: An image batch for the device augmentation: ``[N, C, H, W]``, a list of ``[C, H_i, W_i]`` of many sizes, or
#: such a list packed.
Images = torch.Tensor | PackedImages | Sequence[torch.Tensor]

#: Elements of one padded chunk of a batch of many sizes (with its gather index, about 13 bytes each).
_CHUNK_ELEMENTS = 1 << 25


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return unit_float(x) if x.dtype != torch.float32 else x.float()


def _resize_boxes(x: torch.Tensor, boxes: torch.Tensor, s: int) -> torch.Tensor:
    """The crops ``boxes`` [N, 4] (top, left, h, w) of float images ``x`` [N, C, H, W], resized to ``s`` x ``s``."""
    top, left, bh, bw = boxes.to(x.dtype).unbind(1)
    rows = torch.arange(len(boxes), device=x.device, dtype=x.dtype)
    rois = torch.stack([rows, left, top, left + bw, top + bh], 1)
    # sampling_ratio=-1: per box, ceil(crop / s) samples per output pixel and axis: one (plain bilinear, as
    # F.interpolate) when the crop is enlarged, an average of several (a box filter) when it is shrunk
    from torchvision.ops import roi_align  # (imported on the first device crop, not with sslkit)

    return roi_align(x, rois, output_size=(s, s), spatial_scale=1.0, sampling_ratio=-1, aligned=True)


def channels_of(images: Images) -> int:
    """The channel count of a batch: one tensor, a packed batch (:func:`pack`'s) or a list of ``[C, H, W]`` images."""
    if isinstance(images, torch.Tensor):
        return images.shape[1]
    return images.channels if isinstance(images, PackedImages) else images[0].shape[0]


def pack(images: Images) -> torch.Tensor | PackedImages:
    """A batch as the augmentation takes it: one tensor where all images have one size, else packed."""
    if isinstance(images, torch.Tensor):
        return images
    packed = images if isinstance(images, PackedImages) else PackedImages.of(images)
    stacked = packed.stacked()
    return packed if stacked is None else stacked


def crop_and_resize(images: Images, u: torch.Tensor, size: int, scale: Sequence[float],
                    ratio: Sequence[float]) -> torch.Tensor:
    """Random resized crops ``[N, C, size, size]`` (float in [0, 1]) of a batch, boxes from uniforms ``u``.

    ``images`` is uint8 (or float in [0, 1]): one tensor ``[N, C, H, W]``, or images of many sizes (a list, or
    :class:`PackedImages`), each cropped within its own size: the batch is resized in padded chunks of bounded
    size, one ``roi_align`` each (host-side sizes only: no sync).
    """
    images = pack(images)
    if isinstance(images, torch.Tensor):
        x = _as_float(images)
        boxes = crop_boxes(u, x.shape[2], x.shape[3], scale, ratio)
        return _resize_boxes(x, boxes, size).clamp_(0.0, 1.0)
    boxes = crop_boxes(u, images.hw[:, 0], images.hw[:, 1], scale, ratio)
    out = [_resize_boxes(_as_float(images.padded(first, last)), boxes[first:last], size)
           for first, last in images.chunks(_CHUNK_ELEMENTS)]
    return torch.cat(out).clamp_(0.0, 1.0)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """``[N, 1, H, W]`` luma of RGB ``[N, 3, H, W]`` (the channel mean otherwise)."""
    if x.shape[1] != 3:
        return x.mean(1, keepdim=True)
    return (x[:, 0:1] * _GRAY[0] + x[:, 1:2] * _GRAY[1] + x[:, 2:3] * _GRAY[2])


def _shift_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate the HSV hue of RGB ``[N, 3, H, W]`` in [0, 1] by ``shift`` [N] turns (value and saturation kept)."""
    maxc, argmax = x.max(1)
    minc = x.amin(1)
    delta = maxc - minc
    r, g, b = x.unbind(1)
    diffs = torch.stack([g - b, b - r, r - g], dim=1)
    h6 = diffs.gather(1, argmax.unsqueeze(1)).squeeze(1).div(delta + 1e-12) + 2 * argmax
    # the R, G, B phases 0, 4, 2 in the HSV hexagon, made on the device (no copy from the host)
    phases = (torch.arange(3, dtype=x.dtype, device=x.device) * 4).remainder(6).view(1, 3, 1, 1)
    k = (h6.unsqueeze(1) + (phases + 6.0 * shift.view(-1, 1, 1, 1))).remainder(6.0).sub(3.0).abs().sub(1.0)
    return torch.addcmul(minc.unsqueeze(1), delta.unsqueeze(1), k.clamp(0.0, 1.0))


def _blur_matrices(n: int, sigma: torch.Tensor, kernel_size: int,
                   taps: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[N, n, n]`` matrices applying a Gaussian of per-sample ``sigma`` [N] along an axis of ``n`` pixels
    (reflect padding), as the per-image transform's blur. ``taps``: :func:`blur_taps` of ``n`` and the kernel's
    half width on ``sigma``'s device (looked up when not given)."""
    half = kernel_size // 2
    offsets = torch.arange(-half, half + 1, dtype=torch.float32, device=sigma.device)
    k1 = torch.exp(-0.5 * (offsets[None] / sigma[:, None].float()) ** 2)
    k1 = k1 / k1.sum(1, keepdim=True)  # [N, K]
    rows, src = taps if taps is not None else blur_taps(n, half, str(sigma.device))
    flat = (rows * n + src)[None].expand(len(sigma), -1)
    out = torch.zeros(len(sigma), n * n, dtype=torch.float32, device=sigma.device)
    return out.scatter_add_(1, flat, k1.repeat(1, n)).view(-1, n, n)


class DeviceSimCLRAugment:
    """SimCLR-style views of a batch ``[N, C, H, W]`` (uint8, or float in [0, 1]) on its own device.

    Takes the same arguments as :class:`SimCLRTransform` (its validation applies). ``views(images, u)``
    gives one view per image from uniforms ``u`` [N, UNIFORMS_PER_VIEW]; ``__call__(images, generator)``
    draws them from ``generator`` (on the images' device) and returns ``num_views`` views of the batch.
    """

    def __init__(self, image_size: int, **kwargs: object) -> None:
        self.spec = SimCLRTransform(image_size, **kwargs)  # type: ignore[arg-type]
        self._stats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.compiled: Any = None

    @classmethod
    def from_transform(cls, spec: SimCLRTransform) -> DeviceSimCLRAugment:
        """The device version of an existing per-image transform (same settings)."""
        augment = cls.__new__(cls)
        augment.spec = spec
        augment._stats = {}
        augment.compiled = None
        return augment

    def views(self, images: Images, u: torch.Tensor) -> torch.Tensor:
        """One augmented, normalised float32 view ``[N, C, s, s]`` per image, from uniforms ``u``.

        ``images`` is a batch ``[N, C, H, W]`` or a list of ``[C, H_i, W_i]`` images of many sizes (a folder
        of photos): each is cropped within its own size."""
        spec = self.spec
        c = channels_of(images)
        if u.shape[1] != spec.uniforms(c):  # (before the crop, which reads the first of them)
            raise ValueError(f"{u.shape[1]} uniforms per view for {c}-channel images: this augmentation draws "
                             f"{spec.uniforms(c)}")
        x = crop_and_resize(images, u, spec.image_size, spec.crop_scale, spec.crop_ratio)
        mean, inv_std = self._normalisation(x.shape[1], x.device)
        taps = blur_taps(spec.image_size, spec.blur_kernel // 2, str(x.device))
        pixels = self._pixels if self.compiled is None else self.compiled
        return pixels(x, u[:, 40:].to(x.dtype), mean, inv_std, taps)

    def _pixels(self, x: torch.Tensor, v: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor,
                taps: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Everything after the crop, on crops ``x`` [N, C, s, s] with the view's uniforms ``v`` past the crop's:
        flip, jitter, grayscale, blur, solarisation, normalisation. Elementwise work on the whole batch: what
        :meth:`compile` fuses into few kernels."""
        spec = self.spec
        c, s = x.shape[1], x.shape[-1]
        x = torch.where((v[:, 0] < spec.hflip_p).view(-1, 1, 1, 1), x.flip(-1), x)
        x = self._jitter(x, v[:, 1] < spec.jitter_p, v[:, 2:10], v[:, 14:])
        if c == 3:
            x = torch.where((v[:, 10] < spec.grayscale_p).view(-1, 1, 1, 1), _luma(x).expand(-1, 3, -1, -1), x)
        if spec.blur_p > 0:
            lo, hi = spec.blur_sigma
            m = _blur_matrices(s, lo + v[:, 12] * (hi - lo), spec.blur_kernel, taps).unsqueeze(1)  # [N, 1, s, s]
            blurred = torch.matmul(torch.matmul(m, x), m.transpose(-1, -2))
            x = torch.where((v[:, 11] < spec.blur_p).view(-1, 1, 1, 1), blurred, x)
        if spec.solarize_p > 0:
            solar = torch.where(x >= 0.5, 1.0 - x, x)
            x = torch.where((v[:, 13] < spec.solarize_p).view(-1, 1, 1, 1), solar, x)
        return (x - mean) * inv_std

    def compile(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Run the pixel operations through ``torch.compile`` (``machine.compile``): on a GPU the ~100
        elementwise passes over the batch become a few fused kernels. The same results to float rounding."""
        self.compiled = torch.compile(self._pixels, backend=backend, mode=mode, dynamic=False)

    def _normalisation(self, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-channel mean and 1 / std on ``device``, copied there once (not in every step)."""
        key = (channels, str(device))
        if key not in self._stats:
            made = []
            for name, values in (("mean", self.spec.normalize.mean), ("std", self.spec.normalize.std)):
                values = [0.5] * channels if values is None else list(values)
                values = values * channels if len(values) == 1 else values
                if len(values) != channels:
                    raise ValueError(f"transform {name} has {len(values)} values but the images have {channels} "
                                     "channel(s)")
                made.append(torch.tensor(values, dtype=torch.float32, device=device).view(1, channels, 1, 1))
            self._stats[key] = (made[0], 1.0 / made[1])
        return self._stats[key]

    def _jitter(self, x: torch.Tensor, apply: torch.Tensor, v: torch.Tensor, per_channel: torch.Tensor) -> torch.Tensor:
        """Brightness, contrast, saturation, hue with per-sample factors, each sample in its own random order:
        in round r every sample applies its r-th adjustment (the other three are neutral for it). With
        ``per_channel`` ``[N, 2C]`` (``jitter_per_channel``), brightness and contrast take a factor per channel,
        contrast towards each channel's own mean."""
        strength = self.spec.jitter_strength
        if strength <= 0:
            return x
        b, c, sat, hue = 0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength
        factors = torch.stack([
            max(0.0, 1 - b) + v[:, 0] * (1 + b - max(0.0, 1 - b)),
            max(0.0, 1 - c) + v[:, 1] * (1 + c - max(0.0, 1 - c)),
            max(0.0, 1 - sat) + v[:, 2] * (1 + sat - max(0.0, 1 - sat)),
            -hue + v[:, 3] * 2 * hue,
        ], 1)
        order = torch.argsort(v[:, 4:8], dim=1, stable=True)  # as sorted(range(4), key=u[4 + i])
        if per_channel.shape[1]:
            return self._channel_jitter(x, apply, order, factors, per_channel)
        rgb = x.shape[1] == 3
        view = (-1, 1, 1, 1)
        affine = 3 if rgb else 2  # brightness, contrast and (RGB only) saturation are blends: one fused pass
        for r in range(4):
            op = torch.where(apply, order[:, r], -1)
            f = factors.gather(1, order[:, r : r + 1]).squeeze(1)
            # brightness f*x, contrast f*x + (1-f)*mean(luma), saturation f*x + (1-f)*luma: a*x + b + c*luma
            a = torch.where((op >= 0) & (op < affine), f, 1.0).view(view)
            luma = _luma(x) if rgb else x
            b = torch.where(op == 1, 1 - f, 0.0).view(view) * luma.mean(dim=(1, 2, 3), keepdim=True)
            if rgb:
                c = torch.where(op == 2, 1 - f, 0.0).view(view)
                x = torch.addcmul(torch.addcmul(b, a, x), c, luma).clamp_(0.0, 1.0)
                x = torch.where(((op == 3) & (f != 0)).view(view), _shift_hue(x, f), x)
            else:
                x = torch.addcmul(b, a, x).clamp_(0.0, 1.0)
        return x

    def _channel_jitter(self, x: torch.Tensor, apply: torch.Tensor, order: torch.Tensor, factors: torch.Tensor,
                        per_channel: torch.Tensor) -> torch.Tensor:
        """:meth:`_jitter` with a brightness and a contrast factor per channel (``per_channel`` ``[N, 2C]``: the
        per-image transform's ``_channel_contrast``); saturation and hue (RGB) as one factor per sample."""
        n, c = x.shape[:2]
        lo, hi = max(0.0, 1 - 0.8 * self.spec.jitter_strength), 1 + 0.8 * self.spec.jitter_strength
        bright = lo + per_channel[:, :c] * (hi - lo)  # brightness and contrast: one range
        contrast = lo + per_channel[:, c : 2 * c] * (hi - lo)
        rgb = c == 3
        for r in range(4):
            op = torch.where(apply, order[:, r], -1).view(-1, 1)
            f = factors.gather(1, order[:, r : r + 1])  # [N, 1]: saturation's and hue's factor
            keep = torch.where(op == 2, f, 1.0) if rgb else 1.0
            a = torch.where(op == 0, bright, torch.where(op == 1, contrast, keep)).view(n, c, 1, 1)
            shift = (torch.where(op == 1, 1 - contrast, 0.0) * x.mean(dim=(2, 3))).view(n, c, 1, 1)
            if rgb:  # saturation: f * x + (1 - f) * luma of the image before this round
                shift = torch.addcmul(shift, torch.where(op == 2, 1 - f, 0.0).view(-1, 1, 1, 1), _luma(x))
            x = torch.addcmul(shift, a, x).clamp_(0.0, 1.0)
            if rgb:
                x = torch.where(((op == 3) & (f != 0)).view(-1, 1, 1, 1), _shift_hue(x, f.view(-1)), x)
        return x

    def __call__(self, images: Images, generator: torch.Generator) -> list[torch.Tensor]:
        """``num_views`` views of the batch, their uniforms drawn from ``generator`` (one call per view)."""
        images = pack(images)
        n, device = len(images), images.device
        width = self.spec.uniforms(channels_of(images))
        return [self.views(images, torch.rand(n, width, generator=generator, dtype=torch.float64, device=device))
                for _ in range(self.spec.num_views)]

    @property
    def num_views(self) -> int:
        """Views per image."""
        return self.spec.num_views


class DeviceAugment:
    """Groups of :class:`DeviceSimCLRAugment` applied in order: the device version of a multi-crop transform
    (SwAV, DINO: the global crops, then the local ones at their own size), or of one SimCLR-style transform.
    ``__call__(images, generator)`` returns every group's views, group after group, as the per-image
    transform's list."""

    def __init__(self, groups: Sequence[DeviceSimCLRAugment]) -> None:
        """Apply ``groups`` in order; they must agree on ``jitter_per_channel`` (one width of uniforms a view)."""
        self.groups = list(groups)
        if len({g.spec.jitter_per_channel for g in self.groups}) > 1:
            raise ValueError("the crops' groups disagree on jitter_per_channel: give every group the same")
        self.per_channel = bool(self.groups) and self.groups[0].spec.jitter_per_channel

    def uniforms(self, channels: int) -> int:
        """Uniforms per view for ``channels``-channel images (:meth:`SimCLRTransform.uniforms`)."""
        return self.groups[0].spec.uniforms(channels) if self.groups else UNIFORMS_PER_VIEW

    def compile(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Compile every group's pixel operations (:meth:`DeviceSimCLRAugment.compile`)."""
        for group in self.groups:
            group.compile(backend, mode)

    @property
    def num_views(self) -> int:
        """Views per image, all groups together."""
        return sum(group.num_views for group in self.groups)

    def __call__(self, images: Images, generator: torch.Generator) -> list[torch.Tensor]:
        """Every group's ``num_views`` views of the batch, drawn from ``generator`` (the batch packed once)."""
        images = pack(images)
        return [view for group in self.groups for view in group(images, generator)]

    def apply(self, images: Images, uniforms: torch.Tensor) -> list[torch.Tensor]:
        """Every view of the batch from given uniforms ``[N, num_views, UNIFORMS_PER_VIEW]`` (view after view, in
        the per-image transform's order): with the uniforms :class:`ReadForDevice` draws per sample, the views
        of the per-image transform for the same (seed, epoch, index)."""
        images = pack(images)
        width = self.uniforms(channels_of(images))
        if uniforms.shape[1:] != (self.num_views, width):
            raise ValueError(f"uniforms of shape {tuple(uniforms.shape)} for {self.num_views} views of {width}")
        views, k = [], 0
        for group in self.groups:
            for _ in range(group.num_views):
                views.append(group.views(images, uniforms[:, k]))
                k += 1
        return views


class ReadForDevice:
    """The loader workers' "transform" under ``data.augment_on=device``: the image as read (uint8 ``[C, H, W]``,
    or a JPEG's bytes) and the uniforms of its ``num_views`` views ``[num_views, UNIFORMS_PER_VIEW]``, drawn as
    the per-image transform draws them. :class:`~sslkit.data.SSLDataset` seeds the draw from (seed, epoch,
    index), so a sample's augmentation does not depend on its batch, the number of processes or a resume, and
    equals the workers pipeline's, parameter for parameter."""

    def __init__(self, num_views: int, per_channel: bool = False) -> None:
        """Draw the uniforms of ``num_views`` views per image (2 a channel more each with ``per_channel``: the
        transform's ``jitter_per_channel``)."""
        self.num_views = num_views
        self.per_channel = per_channel

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        """``[image, uniforms]`` (a 16-bit image as float32 in 0..1: the device's uint16 support is thin)."""
        if image.dtype == torch.uint16:
            image = unit_float(image)
        width = view_uniforms(image.shape[0], self.per_channel)
        return [image, torch.rand(self.num_views, width, dtype=torch.float64)]


def device_augment_for(transform: object) -> DeviceAugment:
    """The device version of a per-image training transform (``simclr`` or ``multicrop``); a transform without
    one is an error that names it."""
    if isinstance(transform, SimCLRTransform):
        return DeviceAugment([DeviceSimCLRAugment.from_transform(transform)])
    if isinstance(transform, MultiCropTransform):
        if transform.teacher_size is not None:
            raise ValueError(f"the teacher's crops at {transform.teacher_size} px (a Gram teacher's high-resolution "
                             "crops) have no device version yet: augment on the loader workers "
                             "(data.augment_on=workers)")
        return DeviceAugment([DeviceSimCLRAugment.from_transform(g) for g in transform.groups])
    raise ValueError(f"{type(transform).__name__} has no device version yet: augment on the loader workers "
                     "(the simclr and multicrop transforms have one)")
