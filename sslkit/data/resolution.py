"""A high-resolution phase of training: crop sizes that change from a given update, drawn per batch."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sslkit.data.seeding import mix_seed

__all__ = ["HighResPhase", "PhasedTransform", "phase_errors"]

#: Mixed into the seed of the per-update size draw, so that it is independent of the augmentation streams.
_SIZE_STREAM = 0x48525253


@dataclass(frozen=True)
class HighResPhase:
    """DINOv3's high-resolution adaptation (Siméoni et al. 2025, section 5.1; facebookresearch/dinov3
    ``configs/train/dinov3_vit7b16_high_res_adapt.yaml`` and ``train/train.py``,
    ``build_multi_resolution_data_loader_from_cfg``): from update ``start_step`` on, each batch is cropped at one
    of several ``(global, local, teacher)`` size triples, drawn with probabilities ``ratios`` (DINOv3's
    ``global_local_crop_pairs_ratios``; its ``CombinedDataLoader`` draws one loader per batch with one seeded
    generator shared by every rank). Here the draw is a pure function of ``(seed, update)`` (:meth:`choice`): every
    rank and every micro-batch of an update crop alike, and a resumed run, on any number of processes, draws what
    the run it continues drew. ``teacher`` sizes are the Gram teacher's crops (None: none)."""

    start_step: int
    global_sizes: tuple[int, ...]
    local_sizes: tuple[int, ...]
    teacher_sizes: tuple[int | None, ...]
    ratios: tuple[float, ...]
    seed: int = 0

    def choice(self, update: int) -> int | None:
        """The size triple of ``update``: its index, or None before the phase."""
        if update < self.start_step:
            return None
        if len(self.ratios) == 1:
            return 0
        u = mix_seed(self.seed, _SIZE_STREAM, update) / 2.0**63
        total = sum(self.ratios)
        cumulative = list(itertools.accumulate(r / total for r in self.ratios))
        return min(bisect.bisect_right(cumulative, u), len(self.ratios) - 1)

    def sizes(self, index: int) -> tuple[int, int, int | None]:
        """The ``(global, local, teacher)`` sizes of triple ``index``."""
        return self.global_sizes[index], self.local_sizes[index], self.teacher_sizes[index]

    def stage(self, update: int) -> str:
        """``"high_res"`` from :attr:`start_step` on, ``"base"`` before: the phase the clock reports."""
        return "base" if update < self.start_step else "high_res"


class PhasedTransform:
    """The training transform of a run with a :class:`HighResPhase`: ``base`` before the phase, then the transform
    of the update's size triple (``phases[i]``, built like ``base`` at those sizes). :class:`~sslkit.data.SSLDataset`
    calls :meth:`at` with the update each sample's key names (the sampler's ``track_updates``)."""

    def __init__(self, base: Callable[[torch.Tensor], Any], phase: HighResPhase,
                 phases: Sequence[Callable[[torch.Tensor], Any]]) -> None:
        """``phases``: one transform per size triple of ``phase``."""
        if len(phases) != len(phase.ratios):
            raise ValueError(f"{len(phases)} transforms for {len(phase.ratios)} size triples")
        self.base, self.phase, self.phases = base, phase, list(phases)

    def at(self, update: int) -> Callable[[torch.Tensor], Any]:
        """The transform of the batches of ``update``."""
        index = self.phase.choice(update)
        return self.base if index is None else self.phases[index]

    def __call__(self, image: torch.Tensor) -> Any:
        """The base transform (a key without an update: evaluation, or a sampler that does not track them)."""
        return self.base(image)

    def __repr__(self) -> str:
        return f"PhasedTransform({self.base!r}, {self.phase})"


def phase_errors(start: Any, global_sizes: Sequence[Any], local_sizes: Sequence[Any], teacher_sizes: Sequence[Any],
                 ratios: Sequence[Any], patch: int | None, steps: int | None) -> list[str]:
    """What does not hold in a ``hires.*`` section (plain values; ``patch``: the trunk's patch size, None for a
    trunk without patches; ``steps``: the run's length when known): each message names the key and what would
    work."""
    if start is None:
        return []
    errors = []
    if patch is None:
        return ["'hires.start_step' is set, but the trunk has no patch grid: a high-resolution phase feeds a ViT "
                "(its rotary or interpolated positions take any grid) crops of other sizes; a CNN's features would "
                "change meaning with the crop size. Use a ViT trunk (model.trunk=vit_small_patch16_dinov3, ...) or "
                "drop hires.start_step"]
    if not isinstance(start, int) or start < 0:
        errors.append(f"'hires.start_step' must be a step number >= 0 (or null: no phase), got {start!r}")
    elif steps is not None and start >= steps:
        errors.append(f"'hires.start_step' = {start} is after the run's end: it makes {steps} steps (0 to "
                      f"{steps - 1}), so the phase would never run. Lower hires.start_step (below {steps}) or "
                      "lengthen the run (optim.epochs, optim.max_steps)")
    lengths = {"hires.global_sizes": len(global_sizes), "hires.local_sizes": len(local_sizes),
               "hires.ratios": len(ratios)}
    if teacher_sizes:
        lengths["hires.teacher_sizes"] = len(teacher_sizes)
    if len(set(lengths.values())) > 1 or not global_sizes:
        errors.append("the high-resolution phase draws one size triple per batch: give as many "
                      f"{', '.join(lengths)} (now {', '.join(str(n) for n in lengths.values())}), at least one "
                      "(hires.teacher_sizes may be [] : no teacher crops)")
        return errors
    for key, values in (("hires.global_sizes", global_sizes), ("hires.local_sizes", local_sizes),
                        ("hires.teacher_sizes", teacher_sizes)):
        for v in values:
            if key == "hires.teacher_sizes" and v is None:
                continue
            if not isinstance(v, int) or v < 1 or v % patch:
                errors.append(f"'{key}' holds {v!r}: every size must be a multiple of the trunk's {patch} px patch "
                              f"(e.g. {max(patch, (int(v) // patch) * patch if isinstance(v, int) else patch)})")
                break
    for g, loc in zip(global_sizes, local_sizes):
        if isinstance(g, int) and isinstance(loc, int) and loc > g:
            errors.append(f"'hires.local_sizes' holds {loc} > the global size {g} of its triple: local crops must not "
                          "be larger than the global ones")
            break
    if any(not isinstance(r, int | float) or r < 0 for r in ratios) or not sum(ratios) > 0:
        errors.append(f"'hires.ratios' = {list(ratios)}: probabilities >= 0 with a positive sum (one per size triple)")
    return errors
