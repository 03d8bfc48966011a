"""Split a model's trainable parameters into weight-decay and no-decay (bias / norm) optimizer groups."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["param_groups"]


def param_groups(
    model: nn.Module, weight_decay: float, exclude_bias_and_norm: bool = True
) -> list[dict[str, Any]]:
    """Return optimizer parameter groups for ``model``'s trainable parameters.

    With ``exclude_bias_and_norm`` (the SimCLR / BYOL / MoCo v3 convention), every parameter with
    ``ndim <= 1`` -- biases and the affine weights of BatchNorm / LayerNorm / GroupNorm, also
    1-d tokens such as scalar temperatures -- goes to a ``"no_decay"`` group with ``weight_decay``
    0.0 and ``lars_exclude=True`` (LARS then skips the trust-ratio adaptation for it); all other
    parameters go to a ``"decay"`` group with ``weight_decay``. Without it, one ``"decay"`` group
    holds everything.

    Only parameters with ``requires_grad`` are included; each appears exactly once (shared
    parameters are de-duplicated by ``model.named_parameters``). Empty groups are dropped.

    Every group carries:

    * ``"name"``: ``"decay"`` or ``"no_decay"``, for logging;
    * ``"weight_decay"``;
    * ``"lars_exclude"``: whether :class:`~sslkit.optim.LARS` skips adaptation for the group;
    * ``"apply_wd"``: whether a weight-decay schedule (:func:`~sslkit.optim.set_weight_decay`)
      may change the group's weight decay -- True for the decay group, False for the no-decay one.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if exclude_bias_and_norm and p.ndim <= 1:
            no_decay.append(p)
        else:
            decay.append(p)

    groups: list[dict[str, Any]] = []
    if decay:
        groups.append(
            {
                "name": "decay",
                "params": decay,
                "weight_decay": float(weight_decay),
                "lars_exclude": False,
                "apply_wd": True,
            }
        )
    if no_decay:
        groups.append(
            {
                "name": "no_decay",
                "params": no_decay,
                "weight_decay": 0.0,
                "lars_exclude": True,
                "apply_wd": False,
            }
        )
    return groups
