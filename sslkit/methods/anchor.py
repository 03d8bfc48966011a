"""An anchor against forgetting in continued pretraining: the student's CLS and patch tokens held to those a frozen
copy of the starting trunk gives for the same crops and masks, by cosine or mean squared difference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sslkit.methods.base import RunShape

__all__ = ["ANCHOR_METRICS", "anchor_loss", "anchor_rule"]

#: How the student's tokens meet the frozen copy's (``loss.anchor_metric``).
ANCHOR_METRICS = ("cosine", "mse")


def anchor_loss(student_cls: torch.Tensor, student_patches: torch.Tensor, target_cls: torch.Tensor,
                target_patches: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """The anchor to the starting model (Learning without Forgetting, Li & Hoiem 2016: the new network held to the
    old one's responses on the new data; here its features, as NVIDIA TAO's preservation losses and LightlyTrain's
    feature distillation): over the global crops, ``cosine``, the mean of ``1 - cos`` of each CLS token with its
    target plus the same over every patch token; ``mse``, the mean squared difference of the CLS tokens plus that
    of the patch tokens. Tokens ``[B, D]`` and ``[B, N, D]``, after the final norm; the targets carry no gradient."""
    if metric == "cosine":
        return (1 - F.cosine_similarity(student_cls, target_cls, dim=-1)).mean() + \
            (1 - F.cosine_similarity(student_patches, target_patches, dim=-1)).mean()
    if metric == "mse":
        return F.mse_loss(student_cls, target_cls) + F.mse_loss(student_patches, target_patches)
    raise ValueError(f"loss.anchor_metric={metric!r}: use one of {', '.join(ANCHOR_METRICS)}")


def anchor_rule(shape: RunShape) -> list[str]:
    """``loss.anchor_weight`` and ``model.kwargs.anchor`` go together (the weight needs the frozen copy; the copy
    without a weight is a whole trunk held for nothing), with a known metric."""
    weight, held = shape.loss.get("anchor_weight", 0.0), bool(shape.model_kwargs.get("anchor", False))
    metric = shape.loss.get("anchor_metric", "cosine")
    errors = []
    if not isinstance(weight, int | float) or weight < 0:
        errors.append(f"'loss.anchor_weight' must be a number >= 0, got {weight!r}")
    elif weight > 0 and not held:
        errors.append(f"'loss.anchor_weight' = {weight} needs the frozen copy of the starting trunk: set "
                      "model.kwargs.anchor=true")
    elif held and weight == 0:
        errors.append("'model.kwargs.anchor' = true holds a frozen copy of the trunk that nothing reads: set "
                      "loss.anchor_weight > 0 or model.kwargs.anchor=false")
    if metric not in ANCHOR_METRICS:
        errors.append(f"'loss.anchor_metric' = {metric}: use one of {', '.join(ANCHOR_METRICS)}")
    return errors
