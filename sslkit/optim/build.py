"""Build an optimizer (SGD, LARS, Adam, AdamW) from a config name, and set its per-step lr / weight decay."""

from __future__ import annotations

import torch
from torch import nn

from sslkit.errors import did_you_mean
from sslkit.optim.lars import LARS
from sslkit.optim.param_groups import has_layers, param_groups

__all__ = ["OPTIMIZER_NAMES", "build_optimizer", "set_lr", "set_weight_decay"]

OPTIMIZER_NAMES: tuple[str, ...] = ("adam", "adamw", "lars", "sgd")


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    nesterov: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    eta: float = 0.001,
    exclude_bias_and_norm: bool = True,
    layer_decay: float = 1.0,
    patch_embed_lr_mult: float = 1.0,
    trunk_lr_mult: float = 1.0,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over ``model``'s trainable parameters.

    Parameters are split by :func:`~sslkit.optim.param_groups` (biases, norm weights, a ViT's position
    embeddings and tokens get no weight decay and no LARS adaptation when ``exclude_bias_and_norm``;
    ``layer_decay`` < 1 scales the learning rate of a ViT's layers, ``layer_decay ** (num_layers - layer)``,
    and ``patch_embed_lr_mult`` its patch embedding's; ``trunk_lr_mult`` every backbone parameter's, any trunk).
    ``momentum`` and
    ``nesterov`` apply to ``"sgd"`` / ``"lars"``, ``betas`` to ``"adam"`` / ``"adamw"``, ``eta`` to
    ``"lars"``. For ``"adam"`` the weight decay is the coupled L2 penalty of ``torch.optim.Adam``;
    ``"adamw"`` decouples it.

    The trainer drives the learning rate itself: each step it calls :func:`set_lr` with the
    schedule's value (no ``torch.optim.lr_scheduler`` and no ``initial_lr``), and a weight-decay
    schedule calls :func:`set_weight_decay`. Every group carries ``"apply_wd"`` (see
    :func:`set_weight_decay`) and may carry ``"lr_scale"`` (default 1.0).

    Raises:
        ValueError: unknown ``name`` (the message names the closest valid one), the model has
            no trainable parameters, or ``layer_decay`` / ``patch_embed_lr_mult`` is set for a model without
            a layered trunk (a ViT).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer '{name}'.{did_you_mean(name, OPTIMIZER_NAMES)} "
                         f"Valid: {', '.join(OPTIMIZER_NAMES)}.")

    if (layer_decay != 1.0 or patch_embed_lr_mult != 1.0) and not has_layers(model):
        raise ValueError(f"optim.layer_decay={layer_decay} / optim.patch_embed_lr_mult={patch_embed_lr_mult} need a "
                         f"trunk with layers and a patch embedding (a ViT: model.trunk=vit_small, ...); "
                         f"{type(model).__name__} has none. Set them to 1.0.")
    groups = param_groups(model, weight_decay, exclude_bias_and_norm=exclude_bias_and_norm, layer_decay=layer_decay,
                          patch_embed_lr_mult=patch_embed_lr_mult, trunk_lr_mult=trunk_lr_mult)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no parameters with requires_grad=True to optimize")

    opt: torch.optim.Optimizer
    if name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    elif name == "lars":
        opt = LARS(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, nesterov=nesterov)
    elif name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    else:
        opt = torch.optim.Adam(groups, lr=lr, betas=betas, weight_decay=weight_decay)

    for group in opt.param_groups:
        group.setdefault("apply_wd", group["weight_decay"] > 0)
    set_lr(opt, lr)
    return opt


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's ``"lr"`` to ``lr * group.get("lr_scale", 1.0)``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def set_weight_decay(optimizer: torch.optim.Optimizer, wd: float) -> None:
    """Set ``"weight_decay"`` to ``wd`` on the groups that take weight decay; leave the others alone.

    A group takes weight decay when its ``"apply_wd"`` flag is True. Groups from
    :func:`~sslkit.optim.param_groups` set it (True for the decay group, even when it was built
    with weight decay 0, so a schedule may start at 0; False for biases / norm weights); a group
    without the flag takes weight decay when its current weight decay is > 0.
    """
    for group in optimizer.param_groups:
        if group.get("apply_wd", group["weight_decay"] > 0):
            group["weight_decay"] = wd
