"""Masking for masked and JEPA methods: per-sample random numbers on the device, mask generators, the mask stage.

One component serves every method that hides patches (MAE, LeJEPA's variants, iBOT, DINOv2, I-JEPA):

* :class:`SampleKeys` gives each sample of a batch its own random numbers, a counter-based hash of
  ``(seed, epoch, sample index, view)`` computed with integer operations on the training device. The
  same sample gets the same numbers on any device, with 1 or N processes, in any batch and after a
  resume, so masks need no checkpoint and no host-device synchronisation (the augmentation's
  per-sample uniforms, sslkit/data/dataset.py, are drawn from the same tuple);
* generators turn them into :class:`Masks` of fixed shapes: :class:`RandomMasking` (MAE: a fixed number
  of kept patches), :class:`BlockMasking` (BEiT, iBOT, DINOv2: a fraction of the images masked with a
  per-image ratio in a range, blocks of bounded aspect ratio) and :class:`MultiBlockMasking` (I-JEPA:
  target blocks and a context block without them);
* :class:`MaskPlan` is the mask stage of a train step: ``sample["masks"]``, one :class:`Masks` (or None)
  per view, which the step hands to the model as ``model(views, masks=...)``.

A ViT applies a mask by dropping patches (``Masks.keep``: MAE, I-JEPA's context) or by replacing them
with its mask token (``Masks.mask``: iBOT, DINOv2), :meth:`sslkit.models.vit_trunk.ViTTrunk.forward_tokens`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sslkit.data.seeding import mix_seed
from sslkit.registry import register_masking

__all__ = [
    "BlockMasking",
    "MaskGenerator",
    "MaskPlan",
    "Masks",
    "MultiBlockMasking",
    "RandomMasking",
    "SampleKeys",
    "batch_slots",
    "crops_mask",
    "hash32",
]

#: Standard deviations above its mean that :func:`batch_slots` gives the masked patches of a batch: the buffer
#: overflows in about one batch in 3.5 million (a normal tail; the counts of a batch's images are independent).
SLOT_SIGMAS = 5.0

_M32 = 0xFFFFFFFF
#: Salt of the masking streams: their numbers are independent of the augmentation's for the same sample.
_MASK_SALT = 0x6D61736B  # "mask"


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, without overflowing int64 (c split in 16-bit
    halves): the same bits on every device."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 values in ``[0, 2**32)``: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@dataclass
class SampleKeys:
    """The identity of each sample of one view of a batch, and the random numbers that belong to it.

    ``index`` ``[B]`` (int64, on the training device) holds the samples' dataset indices; ``seed``,
    ``epoch`` and ``view`` are the same for the batch. :meth:`bits` and :meth:`uniforms` are pure
    functions of ``(seed, epoch, index[b], view, tag, j)`` for the ``j``-th number of sample ``b``:
    integer hashing on the device (no generator state, nothing to checkpoint, no sync), identical on
    the CPU and CUDA. ``tag`` separates independent streams of one generator.
    """

    seed: int
    epoch: int
    index: torch.Tensor
    view: int = 0

    def bits(self, count: int, tag: int = 0) -> torch.Tensor:
        """``[B, count]`` int64 hash values in ``[0, 2**32)``: sort keys (ties have probability ~ count**2 / 2**33)."""
        key = mix_seed(_MASK_SALT, self.seed, self.epoch, self.view, tag)
        k0, k1 = key & _M32, (key >> 32) & _M32
        index = self.index.to(torch.int64)
        base = hash32((index & _M32) ^ k0)
        base = hash32(base ^ ((index >> 32) & _M32) ^ k1)
        counter = torch.arange(count, device=index.device, dtype=torch.int64)
        counter = hash32(_mul32(counter, 0x9E3779B9) ^ k1)
        return hash32(base[:, None] ^ counter[None, :])

    def uniforms(self, count: int, tag: int = 0) -> torch.Tensor:
        """``[B, count]`` float32 in ``[0, 1)``: the top 24 bits of :meth:`bits`, exactly representable."""
        return (self.bits(count, tag) >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass
class Masks:
    """The mask of one view of a batch over its ``grid`` of ``N = h * w`` patches (raster order).

    * ``mask`` ``[B, N]`` bool: True where the patch is hidden from the encoder (dropped, or replaced by
      the mask token): what a masked method predicts;
    * ``keep`` ``[B, K]`` int64, ascending: the patches the encoder sees when it drops the others (MAE,
      I-JEPA's context), ``K`` fixed by the config; None for generators that replace;
    * ``keep_valid`` ``[B, K]`` bool: which entries of ``keep`` are real (None: all of them). A generator
      whose visible count varies per image pads ``keep`` to its fixed ``K``; the ViT masks the padding out of
      attention, so the encoder computes what it would on the real patches alone;
    * ``targets`` ``[B, T, N]`` bool: I-JEPA's target blocks (None otherwise);
    * ``slots``: a bound on the patches one image hides (generators that replace) or one target block holds
      (multi-block): the fixed number of places a loss over them gathers per image or block,
      :func:`sslkit.methods.dinov2_parts.masked_slots`; None: any number up to ``N``;
    * ``count_moments``: the mean and variance of a bound on the patches one image hides, for a loss that gathers
      the masked patches of a whole batch into one buffer (:func:`batch_slots`); None: no such bound.

    Losses over a varying number of masked patches use ``mask`` as weights (dense sums), never as an
    index (a boolean index has a size only the host learns: a sync).
    """

    grid: tuple[int, int]
    mask: torch.Tensor
    keep: torch.Tensor | None = None
    keep_valid: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    slots: int | None = None
    count_moments: tuple[float, float] | None = None

    @property
    def weight(self) -> torch.Tensor:
        """``mask`` as float ``[B, N]`` weights (1 on hidden patches)."""
        return self.mask.float()

    def restore_order(self) -> torch.Tensor:
        """``[B, N]`` indices that put ``cat([kept tokens, hidden tokens], 1)`` back in raster order, where the
        kept tokens come in ``keep`` order and the hidden ones in raster order (MAE's ``ids_restore``). For masks
        whose ``keep`` is exactly the visible patches, ascending (:class:`RandomMasking`'s)."""
        order = torch.argsort(self.mask.to(torch.int32), dim=1, stable=True)  # visible ascending, then hidden
        return torch.argsort(order, dim=1)


class MaskGenerator(Protocol):
    """What the mask stage needs of a generator: masks of a view's grid from the samples' keys."""

    #: ``drop`` (the encoder sees only ``keep``, exactly the visible patches), ``drop_padded`` (``keep`` padded to a
    #: fixed count, ``keep_valid`` marking the real entries) or ``replace`` (masked patches get the mask token).
    mode: str

    def __call__(self, keys: SampleKeys, grid: tuple[int, int]) -> Masks: ...


def batch_slots(masks: Masks, images: int) -> int:
    """The places a loss gives the masked patches of ``images`` images masked like ``masks``, all in one buffer:
    their expected count plus :data:`SLOT_SIGMAS` standard deviations plus one image's bound, never more than
    ``images x slots`` (every image at its bound: what per-image places would take).

    DINOv2 gathers a batch's masked patches into a buffer of the size its host-side collate computed (its
    ``upperbound``); the masks here are drawn on the device, image by image, so the size is set from their
    distribution instead: a patch head over 65536 prototypes then sees about 0.4 of the rows that per-image places
    give (DINOv2's ViT-S/16 masking, 256 global crops). Past the bound (about one batch in 3.5 million) the last
    images' extra patches are left out of that batch's patch loss (:func:`sslkit.methods.dinov2_parts.masked_slots`).
    """
    n = masks.grid[0] * masks.grid[1]
    per_image = masks.slots or n
    most = images * per_image
    if masks.count_moments is None:
        return most
    mean, var = masks.count_moments
    return min(most, math.ceil(images * mean + SLOT_SIGMAS * math.sqrt(images * max(var, 0.0))) + per_image)


def crops_mask(views: Sequence[torch.Tensor], masks: Sequence[Masks | None], patches: int
               ) -> tuple[torch.Tensor, int]:
    """The masks of crops ``views`` (``masks`` per crop; None: the crop left whole) as one ``[sum B, patches]`` bool
    buffer, crop after crop, and the places a loss gives its masked patches (:func:`batch_slots` of the masks; one
    place, of weight 0, when no crop is masked)."""
    mask = torch.cat([m.mask if m is not None else torch.zeros(v.shape[0], patches, dtype=torch.bool, device=v.device)
                      for v, m in zip(views, masks, strict=True)])
    slots = max((batch_slots(m, mask.shape[0]) for m in masks if m is not None), default=1)
    return mask, slots


def _check_ratio(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


class RandomMasking:
    """MAE's random masking (He et al. 2022, section 3): every image keeps ``K = int(N * (1 - ratio))``
    patches chosen uniformly at random (MAE's ``len_keep``) and hides the other ``N - K``; ``K`` is the same
    for every image, so the encoder's input has a fixed shape. The patches are ranked by their sample's
    hash bits (MAE ranks by uniform noise) and the first ``K`` are kept. ``mode = "drop"``.
    """

    mode = "drop"

    def __init__(self, ratio: float = 0.75) -> None:
        _check_ratio("masking.ratio", ratio)
        self.ratio = float(ratio)

    def num_kept(self, num_patches: int) -> int:
        """``K``: the patches each image keeps (at least one)."""
        return max(1, int(num_patches * (1.0 - self.ratio)))

    def __call__(self, keys: SampleKeys, grid: tuple[int, int]) -> Masks:
        """Masks for the batch: ``keep`` ``[B, K]`` ascending, ``mask`` True on the ``N - K`` others."""
        n = grid[0] * grid[1]
        k = self.num_kept(n)
        order = torch.argsort(keys.bits(n), dim=1, stable=True)  # patches in the order of their noise
        rank = torch.argsort(order, dim=1)
        mask = rank >= k
        keep = torch.argsort(mask.to(torch.int32), dim=1, stable=True)[:, :k]
        return Masks(grid=grid, mask=mask, keep=keep)


class BlockMasking:
    """Block-wise masking (BEiT, Bao et al. 2022, Algorithm 1; iBOT; DINOv2's ``MaskingGenerator``).

    Each image is masked with probability ``probability``; a masked image hides about ``int(N * r)``
    patches, ``r`` uniform in ``[ratio_min, ratio_max]``, as rectangular blocks: each attempt draws an
    area uniform in ``[min_patches, min(remaining, max_patches)]`` and a log-uniform aspect ratio in
    ``[min_aspect, 1 / min_aspect]``, sets ``h = round(sqrt(area * aspect))`` and ``w = round(sqrt(area /
    aspect))``, places the block uniformly (BEiT: only if ``h < H`` and ``w < W``) and keeps it when it
    adds between 1 and ``min(remaining, max_patches)`` new patches. BEiT tries 10 times per block and
    loops until the target is reached or a block fails 10 times; here every image makes ``attempts``
    attempts (a fixed number: no host loop on data), one per round, all images at once on the device.
    The count reached is at most the target, as BEiT's. Each image decides from its own numbers: unlike
    DINOv2's collate, which masks exactly ``int(B * p)`` images of a batch with ratios spread over the
    range, the masked fraction is ``p`` in expectation, and a sample's mask does not depend on its batch
    (so 1 and N processes agree). ``mode = "replace"``; ``max_patches`` None means no cap (iBOT), a float in
    (0, 1] a share of the grid's ``N`` patches (``floor(N x share)``: DINOv2 caps a block at half the patches,
    ``0.5``, which follows the grid when crop sizes change), an int a number of patches.
    """

    mode = "replace"

    def __init__(self, probability: float = 0.5, ratio_min: float = 0.1, ratio_max: float = 0.5,
                 min_patches: int = 4, max_patches: int | float | None = None, min_aspect: float = 0.3,
                 attempts: int = 30) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"masking.probability must be in [0, 1], got {probability}")
        _check_ratio("masking.ratio_min", ratio_min)
        _check_ratio("masking.ratio_max", ratio_max)
        if ratio_min > ratio_max:
            raise ValueError(f"masking.ratio_min={ratio_min} is above masking.ratio_max={ratio_max}")
        share = isinstance(max_patches, float)
        if min_patches < 1 or (max_patches is not None and not share and max_patches < 1):
            raise ValueError("masking.min_patches and masking.max_patches must be >= 1 (or max_patches a share of "
                             "the patches in (0, 1])")
        if share and not 0.0 < max_patches <= 1.0:
            raise ValueError(f"masking.max_patches={max_patches}: a share of the patches must be in (0, 1] (an int "
                             "is a number of patches)")
        if not 0.0 < min_aspect <= 1.0:
            raise ValueError(f"masking.min_aspect must be in (0, 1], got {min_aspect}")
        if attempts < 1:
            raise ValueError(f"masking.attempts must be >= 1, got {attempts}")
        self.probability, self.ratio_min, self.ratio_max = float(probability), float(ratio_min), float(ratio_max)
        self.min_patches, self.max_patches = int(min_patches), max_patches
        self.log_aspect = (math.log(min_aspect), -math.log(min_aspect))
        self.attempts = int(attempts)

    def max_masked(self, num_patches: int) -> int:
        """A bound on the patches one image can hide: ``ceil(N * ratio_max)`` (a count never passes its target,
        ``floor(N * r)`` in float32; the ceiling covers its rounding). A loss over the masked patches gathers this many
        slots per image (:func:`sslkit.methods.dinov2_parts.masked_slots`)."""
        return max(1, math.ceil(num_patches * self.ratio_max))

    def block_cap(self, num_patches: int) -> float | None:
        """The most patches one block may add on a grid of ``num_patches`` (None: no cap)."""
        if self.max_patches is None:
            return None
        if isinstance(self.max_patches, float):
            return float(math.floor(num_patches * self.max_patches))
        return float(self.max_patches)

    def count_moments(self, num_patches: int) -> tuple[float, float]:
        """The mean and variance of an image's target ``[masked] floor(N r)``, which bounds what it hides, with
        ``N r`` for its floor (a larger mean; the second moment of the continuous ``r``): for :func:`batch_slots`."""
        p, a, b = self.probability, num_patches * self.ratio_min, num_patches * self.ratio_max
        mean = p * (a + b) / 2
        return mean, p * (a * a + a * b + b * b) / 3 - mean * mean

    def targets(self, keys: SampleKeys, num_patches: int) -> torch.Tensor:
        """``[B]`` the number of patches each image aims to hide: 0 for unmasked images."""
        u = keys.uniforms(2, tag=0)
        ratio = self.ratio_min + (self.ratio_max - self.ratio_min) * u[:, 1]
        target = torch.floor(num_patches * ratio)
        return torch.where(u[:, 0] < self.probability, target, torch.zeros_like(target))

    def __call__(self, keys: SampleKeys, grid: tuple[int, int]) -> Masks:
        """Masks for the batch: ``mask`` ``[B, N]``, each image's count at most its target."""
        h_grid, w_grid = grid
        n = h_grid * w_grid
        target = self.targets(keys, n)
        u = keys.uniforms(4 * self.attempts, tag=1).view(-1, self.attempts, 4)
        device = target.device
        rows = torch.arange(h_grid, device=device, dtype=torch.float32)[None]  # [1, H]
        cols = torch.arange(w_grid, device=device, dtype=torch.float32)[None]  # [1, W]
        b = target.shape[0]
        mask = torch.zeros(b, n, dtype=torch.bool, device=device)
        count = torch.zeros_like(target)
        lo, hi = self.log_aspect
        most = self.block_cap(n)
        for a in range(self.attempts):
            ua, ub, uc, ud = u[:, a].unbind(1)
            remaining = target - count
            cap = remaining if most is None else remaining.clamp(max=most)
            area = self.min_patches + (cap - self.min_patches) * ua  # python's uniform(a, b), also for b < a
            aspect = torch.exp(lo + (hi - lo) * ub)
            h = torch.round(torch.sqrt(area * aspect))
            w = torch.round(torch.sqrt(area / aspect))
            fits = (h < h_grid) & (w < w_grid) & (remaining > 0)
            top = torch.floor(uc * (h_grid - h + 1))  # randint(0, H - h), both ends included
            left = torch.floor(ud * (w_grid - w + 1))
            in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # [B, H]
            in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # [B, W]
            block = (in_rows[:, :, None] & in_cols[:, None, :]).view(b, n)
            new = (block & ~mask).sum(dim=1).float()
            take = fits & (new > 0) & (new <= cap)
            mask = mask | (block & take[:, None])
            count = count + new * take
        return Masks(grid=grid, mask=mask, slots=self.max_masked(n), count_moments=self.count_moments(n))


class MultiBlockMasking:
    """I-JEPA's multi-block masking (Assran et al. 2023, section 3; ``src/masks/multiblock.py``).

    Per image: ``num_targets`` target blocks of one size (area ``int(N * s)``, ``s`` uniform in
    ``target_scale``; aspect ratio uniform in ``target_aspect``; ``h = round(sqrt(area * a))``,
    ``w = round(sqrt(area / a))``, below the grid's sides) at independent uniform positions, and a
    context block (``context_scale``, aspect 1) from which every target patch is removed: ``targets``
    ``[B, T, N]``, and ``mask`` every patch the context encoder does not see.

    I-JEPA draws the block sizes once per batch and truncates every mask to the smallest count in the
    batch. Here each image draws its own sizes (so its masks do not depend on its batch) and the context
    has a fixed number of slots, ``context_patches`` (default: the largest context block this config can
    draw, so no context patch is ever cut): ``keep`` ``[B, K]`` holds the image's context patches and, in
    the slots left over, other patches marked invalid in ``keep_valid``, which the ViT leaves out of
    attention. A smaller ``context_patches`` keeps a random subset of a larger context (I-JEPA's
    truncation, per image). ``mode = "drop_padded"``.

    Every context keeps at least ``min_context`` patches (None: I-JEPA's configs' ``min_keep`` 10 of 196 patches,
    scaled to the grid, rounded up: 3 on 7 x 7). I-JEPA redraws a context block that keeps ``min_keep`` or fewer,
    and after every 20 failed draws lifts the exclusion of one more target block, the last ones first
    (``constrain_mask(mask, tries)``), until it fits; a redraw is a loop on data, so here, in one pass on the
    device, each image's context is its block without the first ``T - r`` targets for the smallest ``r`` that
    leaves ``min_context`` patches (``r = 0``: the strict context; the block is always large enough, which
    :meth:`grid_errors` checks with the share of draws that need it).

    The sampler's known biases (:meth:`coverage` measures them; figures in docs/methods.md, I-JEPA): target
    blocks are placed uniformly, so they cover the central patches far more often than the border ones, and the
    context, which loses every target patch, rarely holds the centre (on I-JEPA's 14 x 14 grid the central
    patches are in the context in about 7% of draws, the top-left corner in 94%); and I-JEPA's ``randint(0, H -
    h)`` never places a block on the last row or column (its high end is exclusive), so those patches are in no
    context and no target. sslkit keeps the paper's sampler by default, which is what its results were measured
    with; ``cover_edges=True`` places blocks anywhere (top in ``[0, H - h]``).
    """

    mode = "drop_padded"

    def __init__(self, num_targets: int = 4, target_scale: Sequence[float] = (0.15, 0.2),
                 target_aspect: Sequence[float] = (0.75, 1.5), context_scale: Sequence[float] = (0.85, 1.0),
                 context_patches: int | None = None, min_context: int | None = None,
                 cover_edges: bool = False) -> None:
        if num_targets < 1:
            raise ValueError(f"masking.num_targets must be >= 1, got {num_targets}")
        for name, (a, b) in (("target_scale", target_scale), ("context_scale", context_scale)):
            if not 0 < a <= b <= 1:
                raise ValueError(f"masking.{name} must be [low, high] with 0 < low <= high <= 1, got {[a, b]}")
        if not 0 < target_aspect[0] <= target_aspect[1]:
            raise ValueError(f"masking.target_aspect must be [low, high] with 0 < low <= high, got {target_aspect}")
        if context_patches is not None and context_patches < 1:
            raise ValueError(f"masking.context_patches must be >= 1 (or null), got {context_patches}")
        self.num_targets = int(num_targets)
        self.target_scale = (float(target_scale[0]), float(target_scale[1]))
        self.target_aspect = (float(target_aspect[0]), float(target_aspect[1]))
        self.context_scale = (float(context_scale[0]), float(context_scale[1]))
        self.context_patches = context_patches
        if min_context is not None and min_context < 0:
            raise ValueError(f"masking.min_context must be >= 0 (or null), got {min_context}")
        self.min_context = None if min_context is None else int(min_context)
        self.cover_edges = bool(cover_edges)

    @staticmethod
    def _sides(area: torch.Tensor, aspect: torch.Tensor | float, grid: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Block sides for ``area`` patches of aspect ``aspect``, shrunk below the grid's (I-JEPA: ``while h >= H:
        h -= 1``), at least 1."""
        h = torch.round(torch.sqrt(area * aspect)).clamp(1, max(grid[0] - 1, 1))
        w = torch.round(torch.sqrt(area / aspect)).clamp(1, max(grid[1] - 1, 1))
        return h, w

    def least_context(self, grid: tuple[int, int]) -> int:
        """The context patches every image keeps on ``grid``: ``min_context``, or I-JEPA's 10 of 196 scaled."""
        if self.min_context is not None:
            return self.min_context
        return math.ceil(10 * grid[0] * grid[1] / 196)

    def smallest_block(self, grid: tuple[int, int]) -> int:
        """The fewest patches a context block of this config holds on ``grid`` (its smallest area, aspect 1)."""
        side = max(round(math.sqrt(math.floor(grid[0] * grid[1] * self.context_scale[0]))), 1)
        return min(side, max(grid[0] - 1, 1)) * min(side, max(grid[1] - 1, 1))

    def num_context(self, grid: tuple[int, int]) -> int:
        """``K``: the context slots, ``context_patches`` or the largest context block of this config."""
        n = grid[0] * grid[1]
        if self.context_patches is not None:
            return min(int(self.context_patches), n)
        lo, hi = self.context_scale
        best = 1
        for area in range(math.floor(n * lo), math.floor(n * hi) + 1):  # aspect 1: h = w = round(sqrt(area))
            side = max(round(math.sqrt(area)), 1)
            best = max(best, min(side, max(grid[0] - 1, 1)) * min(side, max(grid[1] - 1, 1)))
        return best

    def max_target_patches(self, grid: tuple[int, int]) -> int:
        """A bound on one target block's patches on ``grid``: the largest ``h * w`` over every area and aspect ratio
        the config can draw (computed at every point where a rounded side changes, and between them). A loss over
        a target's patches gathers this many slots (:func:`sslkit.methods.dinov2_parts.masked_slots`)."""
        n = grid[0] * grid[1]
        lo, hi = self.target_aspect
        best = 1
        for area in range(math.floor(n * self.target_scale[0]), math.floor(n * self.target_scale[1]) + 1):
            area = max(area, 1)
            cuts = [lo, hi] + [(k + 0.5) ** 2 / area for k in range(1, grid[0] + 1)] + \
                [area / (k + 0.5) ** 2 for k in range(1, grid[1] + 1)]
            cuts = sorted(a for a in cuts if lo <= a <= hi)
            points = cuts + [(a + b) / 2 for a, b in itertools.pairwise(cuts)]
            points += [min(hi, a * (1 + 1e-6)) for a in cuts] + [max(lo, a * (1 - 1e-6)) for a in cuts]
            for a in points:  # the sampler's rounding (half to even, as torch.round), in float64
                h = min(max(round(math.sqrt(area * a)), 1), max(grid[0] - 1, 1))
                w = min(max(round(math.sqrt(area / a)), 1), max(grid[1] - 1, 1))
                best = max(best, h * w)
        return best

    def coverage(self, grid: tuple[int, int], draws: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(context, target)`` ``[H, W]``: how often each patch is in the context, and in some target, over
        ``draws`` images (the sampler's spatial bias; see the class docstring)."""
        m = self(SampleKeys(seed, 0, torch.arange(draws, device="cpu")), grid)
        seen = torch.zeros_like(m.mask).scatter(1, m.keep, m.keep_valid)
        return seen.float().mean(0).view(grid), m.targets.any(1).float().mean(0).view(grid)  # type: ignore[union-attr]

    def grid_errors(self, grid: tuple[int, int], where: str = "masking", draws: int = 2048) -> list[str]:
        """What is wrong with this sampler on ``grid`` (empty if nothing): a grid too small for a target block; a
        ``min_context`` more than the smallest context block or the context slots hold; or more than 1% of draws
        whose context without the targets keeps fewer than ``min_context`` patches (their context then takes
        target patches back: a config that needs it that often is mismatched to its grid)."""
        h_grid, w_grid = grid
        n = h_grid * w_grid
        if min(grid) < 2 or math.floor(n * self.target_scale[0]) < 1:
            return [f"'{where}': a {h_grid} x {w_grid} grid of patches is too small for I-JEPA's blocks (a target "
                    f"block needs at least one patch and must be smaller than the grid): use a smaller patch "
                    f"(model.trunk_kwargs.patch_size) or larger crops (data.transform.image_size)"]
        least, room = self.least_context(grid), min(self.smallest_block(grid), self.num_context(grid))
        if least > room:
            return [f"'{where}.min_context' = {least}: more than the {room} patches the smallest context block "
                    f"(context_scale {self.context_scale[0]}) or the context slots (context_patches) hold on the "
                    f"{h_grid} x {w_grid} grid: lower masking.min_context or raise masking.context_scale / "
                    f"masking.context_patches"]
        context = self._strict_context(SampleKeys(0, 0, torch.arange(draws, device="cpu")), grid).sum(1)
        short = float((context < least).float().mean())
        if short > 0.01:
            return [f"'{where}': on the {h_grid} x {w_grid} grid of patches, {short:.0%} of the draws leave the "
                    f"context fewer than min_context={least} patches once the targets are removed (mean "
                    f"{float(context.float().mean()):.1f}"
                    f" of {n}), and would take target patches back: use fewer or smaller targets (masking.num_targets, "
                    f"masking.target_scale), a smaller patch (model.trunk_kwargs.patch_size), larger crops, or a "
                    f"lower masking.min_context"]
        return []

    def _block(self, u: torch.Tensor, h: torch.Tensor, w: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """``[..., N]`` blocks of sides ``h`` x ``w`` at positions from uniforms ``u`` ``[..., 2]``: top in
        ``[0, H - h)`` as I-JEPA's ``randint`` (0 when the block spans the grid), or in ``[0, H - h]`` with
        ``cover_edges``."""
        h_grid, w_grid = grid
        rows = torch.arange(h_grid, device=u.device, dtype=torch.float32)
        cols = torch.arange(w_grid, device=u.device, dtype=torch.float32)
        extra = 1 if self.cover_edges else 0
        top = torch.floor(u[..., 0] * (h_grid - h + extra).clamp(min=1))
        left = torch.floor(u[..., 1] * (w_grid - w + extra).clamp(min=1))
        in_rows = (rows >= top[..., None]) & (rows < (top + h)[..., None])
        in_cols = (cols >= left[..., None]) & (cols < (left + w)[..., None])
        return (in_rows[..., :, None] & in_cols[..., None, :]).flatten(-2)

    def __call__(self, keys: SampleKeys, grid: tuple[int, int]) -> Masks:
        """Masks for the batch: ``targets`` ``[B, T, N]``, the context in ``keep`` / ``keep_valid`` ``[B, K]``,
        ``mask`` True where the context encoder sees nothing."""
        n = grid[0] * grid[1]
        k, slots = self._sizes(grid)
        targets, block = self.blocks(keys, grid)
        context = self._context(targets, block, self.least_context(grid))  # [B, N]
        # the context's patches first (in a random order: a smaller K keeps a random subset), then the rest
        order = torch.argsort((~context).to(torch.int64) * (1 << 32) + keys.bits(n, tag=3), dim=1, stable=True)
        keep = torch.sort(order[:, :k], dim=1).values
        keep_valid = context.gather(1, keep)
        visible = torch.zeros_like(context).scatter(1, keep, keep_valid)
        return Masks(grid=grid, mask=~visible, keep=keep, keep_valid=keep_valid, targets=targets, slots=slots)

    def blocks(self, keys: SampleKeys, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each image's ``targets`` ``[B, T, N]`` and context block ``[B, N]``, targets not yet removed."""
        n, t = grid[0] * grid[1], self.num_targets
        u = keys.uniforms(3 + 2 * t + 2, tag=2)
        scale = self.target_scale[0] + (self.target_scale[1] - self.target_scale[0]) * u[:, 0]
        aspect = self.target_aspect[0] + (self.target_aspect[1] - self.target_aspect[0]) * u[:, 1]
        h, w = self._sides(torch.floor(n * scale), aspect, grid)
        targets = self._block(u[:, 3:3 + 2 * t].view(-1, t, 2), h[:, None], w[:, None], grid)
        c_scale = self.context_scale[0] + (self.context_scale[1] - self.context_scale[0]) * u[:, 2]
        ch, cw = self._sides(torch.floor(n * c_scale), 1.0, grid)
        return targets, self._block(u[:, 3 + 2 * t:], ch, cw, grid)

    @staticmethod
    def _context(targets: torch.Tensor, block: torch.Tensor, least: int) -> torch.Tensor:
        """``[B, N]``: each ``block`` without its first ``T - r`` ``targets``, ``r`` the smallest that leaves ``least``
        patches (I-JEPA lifts the last targets' exclusion first), chosen on the device: no loop on data."""
        t = targets.shape[1]
        excluded, options = torch.zeros_like(block), [block]  # options[j]: the block without the first j targets
        for j in range(t):
            excluded = excluded | targets[:, j]
            options.append(block & ~excluded)
        stacked = torch.stack(options[::-1], dim=1)  # [B, T + 1, N]: r = 0 (every target out) ... r = T (none)
        enough = stacked.sum(dim=2) >= least
        r = torch.where(enough.any(dim=1), enough.to(torch.int32).argmax(dim=1), torch.full_like(block[:, 0], t,
                                                                                              dtype=torch.int64))
        return stacked.gather(1, r[:, None, None].expand(-1, 1, block.shape[1])).squeeze(1)

    def _strict_context(self, keys: SampleKeys, grid: tuple[int, int]) -> torch.Tensor:
        """``[B, N]``: each context block without every target (before :meth:`_context` takes any back)."""
        targets, block = self.blocks(keys, grid)
        return block & ~targets.any(dim=1)

    def _sizes(self, grid: tuple[int, int]) -> tuple[int, int]:
        """``(num_context, max_target_patches)`` of ``grid``, computed once per grid (host arithmetic)."""
        cache = self.__dict__.setdefault("_size_cache", {})
        if grid not in cache:
            cache[grid] = (self.num_context(grid), self.max_target_patches(grid))
        return cache[grid]


class MaskPlan:
    """The mask stage of a train step (sslkit/train_steps/stages.py, ``prepare_sample``).

    For each view in ``views`` (default: every view of the first view's size, the global crops) it draws
    ``generator``'s masks over the view's patch grid (``patch_size``), keyed by ``(seed, epoch, data_idx,
    view)``. Returns one entry per view: :class:`Masks`, or None for a view left whole.
    """

    def __init__(self, generator: MaskGenerator, patch_size: int, seed: int, views: Sequence[int] | None = None):
        self.generator = generator
        self.patch_size = int(patch_size)
        self.seed = int(seed)
        self.views = None if views is None else [int(v) for v in views]

    def __call__(self, views: Sequence[torch.Tensor], index: torch.Tensor, epoch: int) -> list[Masks | None]:
        """The masks of a batch's ``views`` (``[B, C, H, W]`` each), ``index`` ``[B]`` its dataset indices."""
        chosen = self.views if self.views is not None else \
            [v for v, x in enumerate(views) if x.shape[-2:] == views[0].shape[-2:]]
        out: list[Masks | None] = []
        for v, x in enumerate(views):
            if v not in chosen:
                out.append(None)
                continue
            grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
            out.append(self.generator(SampleKeys(self.seed, epoch, index, v), grid))
        return out

    def __repr__(self) -> str:
        return f"MaskPlan({type(self.generator).__name__}, patch {self.patch_size}, views {self.views or 'global'})"


@register_masking("random")
def build_random(ratio: float = 0.75) -> RandomMasking:
    """MAE's random masking: keep ``int(N * (1 - ratio))`` patches of every image (:class:`RandomMasking`)."""
    return RandomMasking(ratio)


@register_masking("block")
def build_block(probability: float = 0.5, ratio_min: float = 0.1, ratio_max: float = 0.5, min_patches: int = 4,
                max_patches: int | float | None = None, min_aspect: float = 0.3, attempts: int = 30) -> BlockMasking:
    """BEiT / iBOT / DINOv2 block masking with the mask token (:class:`BlockMasking`)."""
    return BlockMasking(probability, ratio_min, ratio_max, min_patches, max_patches, min_aspect, attempts)


@register_masking("multi_block")
def build_multi_block(num_targets: int = 4, target_scale: Sequence[float] = (0.15, 0.2),
                      target_aspect: Sequence[float] = (0.75, 1.5), context_scale: Sequence[float] = (0.85, 1.0),
                      context_patches: int | None = None, min_context: int = 10,
                      cover_edges: bool = False) -> MultiBlockMasking:
    """I-JEPA's target blocks and context (:class:`MultiBlockMasking`)."""
    return MultiBlockMasking(num_targets, target_scale, target_aspect, context_scale, context_patches, min_context,
                             cover_edges)
