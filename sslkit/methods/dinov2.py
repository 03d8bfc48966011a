"""DINOv2 (Oquab et al., 2024): iBOT's DINO + masked-patch losses, KoLeo on the CLS tokens, Sinkhorn-Knopp teachers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from sslkit.clock import StepContext
from sslkit.methods.base import Method, RunShape, register_method
from sslkit.methods.dinov2_parts import koleo_loss
from sslkit.methods.ibot import IBOTLoss
from sslkit.methods.sinkhorn import sinkhorn_knopp
from sslkit.registry import register_loss

__all__ = ["DINOV2", "DINOv2Loss", "SinkhornKnoppTeacher", "sinkhorn_batch_rule"]

CENTERING = ("centering", "sinkhorn_knopp")


class SinkhornKnoppTeacher:
    """DINOv2's other teacher-probability rule (``loss.centering=sinkhorn_knopp``): Sinkhorn-Knopp
    (:func:`~sslkit.methods.sinkhorn.sinkhorn_knopp`) over the global batch, for the CLS logits of all global crops
    together and for the masked patches of all global crops (padding slots left out); no centre, nothing moves."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def cls_probs(self, logits: Sequence[torch.Tensor], temp: float) -> torch.Tensor:
        """``[G, B, K]``: one solve over every global crop's CLS logits of the global batch."""
        stacked = torch.stack(list(logits))  # [G, B, K]
        return sinkhorn_knopp(stacked.flatten(0, 1), temp, self.iterations).view(stacked.shape)

    def patch_probs(self, logits: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                    temp: float) -> list[torch.Tensor]:
        """One solve over the masked patches (every slot of weight 1) of every global crop of the global batch."""
        k = logits[0].shape[-1]
        rows = torch.cat([t.reshape(-1, k) for t in logits])  # every slot of every entry: [R, K]
        w = torch.cat([wi.reshape(-1) for wi in weights])
        probs = sinkhorn_knopp(rows, temp, self.iterations, w)
        return [p.view(t.shape) for p, t in zip(probs.split([t[..., 0].numel() for t in logits]), logits)]

    def after_train_forward(self, output: Any, ctx: StepContext | None) -> None:
        """Nothing moves: Sinkhorn-Knopp keeps no state."""


@register_loss("dinov2")
class DINOv2Loss(IBOTLoss):
    """DINOv2's loss (Oquab et al. 2024, section 4; facebookresearch/dinov2 ``ssl_meta_arch.py``)::

        L = dino_weight L_DINO(CLS) + ibot_weight L_iBOT(masked patches) + koleo_weight sum_g KoLeo(z_g)

    ``L_DINO`` and ``L_iBOT`` are :class:`~sslkit.methods.ibot.IBOTLoss`'s terms (DINOv2 scales them to the same
    means: the mean over (teacher, student) crop pairs, and over all images of the per-image mean over masked
    patches). ``z_g`` is the student trunk's CLS token of global crop ``g`` (``features``, before the head), KoLeo
    (:func:`~sslkit.methods.dinov2_parts.koleo_loss`) on each global crop's batch separately ("we don't apply koleo
    loss between cls tokens of a same image"), over the global batch with ``koleo_global`` (DINOv2: each rank's).

    ``centering``: ``centering`` (DINO's centre and softmax, for the CLS tokens and, with its own centre, the masked
    patches) or ``sinkhorn_knopp`` (``sinkhorn_iterations`` of Sinkhorn-Knopp over the global batch: the CLS logits
    of all global crops together, and the masked patches' logits of all global crops, padding slots left out; no
    centre moves). The teacher temperature (warm-up included) is the same for the CLS tokens and the patches, as
    DINOv2's (``teacher_patch_temp`` None: ``teacher_temp``).
    """

    def __init__(self, out_dim: int = 65536, patch_out_dim: int | None = None, student_temp: float = 0.1,
                 teacher_temp: float = 0.07, warmup_teacher_temp: float = 0.04, warmup_teacher_temp_steps: int = 0,
                 teacher_patch_temp: float | None = None, warmup_teacher_patch_temp: float | None = None,
                 center_momentum: float = 0.9, centering: str = "centering", sinkhorn_iterations: int = 3,
                 dino_weight: float = 1.0, ibot_weight: float = 1.0, koleo_weight: float = 0.1,
                 koleo_global: bool = True, warmup_teacher_temp_epochs: float = 0.0) -> None:
        if centering not in CENTERING:
            raise ValueError(f"loss.centering must be one of {', '.join(CENTERING)}, got {centering!r}")
        if sinkhorn_iterations < 1:
            raise ValueError(f"loss.sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}")
        super().__init__(out_dim, patch_out_dim, student_temp, teacher_temp, warmup_teacher_temp,
                         warmup_teacher_temp_steps,
                         teacher_temp if teacher_patch_temp is None else teacher_patch_temp,
                         warmup_teacher_temp if warmup_teacher_patch_temp is None else warmup_teacher_patch_temp,
                         center_momentum, lambda_cls=dino_weight, lambda_patch=ibot_weight,
                         warmup_teacher_temp_epochs=warmup_teacher_temp_epochs)
        self.centering = centering
        self.sinkhorn_iterations = int(sinkhorn_iterations)
        if centering == "sinkhorn_knopp":
            self.teacher_rule = SinkhornKnoppTeacher(self.sinkhorn_iterations)
        self.koleo_weight = float(koleo_weight)
        self.koleo_global = bool(koleo_global)

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """iBOT's loss plus ``koleo_weight`` times the sum over the global crops of KoLeo on their CLS tokens."""
        out = super().forward(output, sample, ctx)
        g = len(output["targets"])
        terms = [koleo_loss(f, gather=self.koleo_global, return_distance=True) for f in output["features"][:g]]
        koleo = torch.stack([t[0] for t in terms]).sum()
        out["loss"] = out["loss"] + self.koleo_weight * koleo
        out["koleo_loss"] = koleo.detach()
        out["koleo_min_distance"] = torch.stack([t[1] for t in terms]).min()
        return out


#: The method object: what ``method.name=dinov2`` trains.
def sinkhorn_batch_rule(shape: RunShape) -> list[str]:
    """``loss.centering=sinkhorn_knopp`` gives every prototype ``1 / K`` of each solve's mass and every teacher row
    ``1 / R`` (``R`` rows: all global crops of all processes), so a row spreads over at least ``K / R`` prototypes:
    its target's entropy is at least ``ln(K / R)``. DINOv2 runs 65536 prototypes on 2048 rows (32 per row, at least
    3.5 of ln K's 11.1 nats). Below ``R = sqrt(K)`` the floor passes half of ``ln K``: the teacher can no longer say
    much about any image, a config error."""
    if shape.loss.get("centering") != "sinkhorn_knopp":
        return []
    b, world = shape.batch_per_process, shape.processes
    crops = int(shape.model_kwargs.get("num_global", 2) or 2)
    k = shape.loss.get("out_dim")
    rows = b * world * crops
    if not isinstance(k, int) or rows * rows >= k:
        return []
    return [f"'loss.centering' = sinkhorn_knopp: each Sinkhorn-Knopp solve sees data.batch_size={b} x "
            f"{world} process(es) x {crops} global crops = {rows} teacher rows for loss.out_dim={k} "
            f"prototypes, so every row must spread over at least {k / rows:.0f} prototypes and the "
            f"teacher's targets are nearly uniform (entropy >= ln({k / rows:.0f}), more than half of "
            f"ln({k})). Raise data.batch_size (to at least {-(-(math.isqrt(k - 1) + 1) // (world * crops))} "
            f"here, or run more processes), lower "
            f"model.head.out_dim and loss.out_dim (at most {rows * rows}), or use loss.centering=centering."]


DINOV2 = register_method(Method(
    name="dinov2", model="ibot", loss="dinov2", required_hooks=("momentum_teacher",), transform="multicrop",
    masking="block", patch_tokens=True, rules=(sinkhorn_batch_rule,),
    summary=("DINOv2 (Oquab et al., 2024): DINO on the CLS token, iBOT on masked patches, KoLeo, Sinkhorn-Knopp"
             " or centring."),
))
