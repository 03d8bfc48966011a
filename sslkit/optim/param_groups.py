"""Split a model's trainable parameters into optimizer groups: weight decay or not, and a learning-rate scale."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["in_trunk", "layer_scales", "no_decay_names", "param_groups", "param_owners"]


def no_decay_names(model: nn.Module) -> set[str]:
    """Full names of the parameters that get no weight decay whatever their shape: those a submodule lists in
    ``no_weight_decay_names()`` (a ViT trunk: position embeddings, CLS, register and mask tokens)."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        listed = getattr(module, "no_weight_decay_names", None)
        if callable(listed):
            names |= {f"{prefix}.{n}" if prefix else n for n in listed()}
    return names


def layer_scales(model: nn.Module, layer_decay: float = 1.0, patch_embed_lr_mult: float = 1.0) -> dict[str, float]:
    """The learning-rate scale of each parameter (by full name) under layer-wise decay.

    A submodule with ``layer_id(name)`` and ``num_layers`` (a ViT trunk) places its parameters in layers:
    the embedding 0, block ``i`` ``i + 1``, its top ``num_layers`` (BEiT, MAE ``util/lr_decay.py``, DINOv2).
    A parameter of layer ``l`` gets ``layer_decay ** (num_layers - l)``; every parameter outside such a
    module (heads, predictors, decoders) is above the top and gets 1. The parameters of its
    ``patch_embed`` are further multiplied by ``patch_embed_lr_mult`` (DINOv2's ``patch_embed_lr_mult``).
    Parameters not listed have scale 1.
    """
    scales: dict[str, float] = {}
    for prefix, module in model.named_modules():
        layer_id = getattr(module, "layer_id", None)
        if not callable(layer_id) or not hasattr(module, "num_layers"):
            continue
        top = int(module.num_layers)  # type: ignore[arg-type]
        for name, _ in module.named_parameters():
            full = f"{prefix}.{name}" if prefix else name
            scale = layer_decay ** (top - layer_id(name))
            if name.startswith("patch_embed."):
                scale *= patch_embed_lr_mult
            scales[full] = scale
    return scales


def in_trunk(name: str) -> bool:
    """Whether the parameter of full name ``name`` belongs to a backbone: a module named ``trunk`` (the model's, or
    a distillation student's ``students.<i>.trunk``)."""
    return name.startswith("trunk.") or ".trunk." in name


def has_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds a module with layers for layer-wise lr decay (a ViT trunk)."""
    return any(callable(getattr(m, "layer_id", None)) and hasattr(m, "num_layers") for m in model.modules())


def param_groups(
    model: nn.Module,
    weight_decay: float,
    exclude_bias_and_norm: bool = True,
    layer_decay: float = 1.0,
    patch_embed_lr_mult: float = 1.0,
    trunk_lr_mult: float = 1.0,
) -> list[dict[str, Any]]:
    """Return optimizer parameter groups for ``model``'s trainable parameters.

    With ``exclude_bias_and_norm`` (the SimCLR / BYOL / MoCo v3 / DINO convention), a parameter with
    ``ndim <= 1`` -- biases, the affine weights of BatchNorm / LayerNorm / GroupNorm, LayerScale gammas,
    1-d tokens such as scalar temperatures -- or named by a submodule's ``no_weight_decay_names()`` (a
    ViT's position embeddings, CLS, register and mask tokens) goes to a ``no_decay`` group with
    ``weight_decay`` 0.0 and ``lars_exclude=True`` (LARS then skips the trust-ratio adaptation for it);
    every other parameter to a ``decay`` group. Without it, every parameter decays.

    ``layer_decay`` < 1 and ``patch_embed_lr_mult`` give parameters learning-rate scales
    (:func:`layer_scales`), and ``trunk_lr_mult`` multiplies every backbone parameter's (:func:`in_trunk`: fresh
    heads on a pretrained trunk learn at the full rate, the trunk slower); parameters are then grouped by (decay,
    scale), each group named ``decay@<scale>`` / ``no_decay@<scale>`` and carrying ``"lr_scale"``, which
    :func:`~sslkit.optim.set_lr` multiplies the scheduled learning rate by. With none of them, the groups are
    ``decay`` and ``no_decay``.

    Only parameters with ``requires_grad`` are included (a frozen parameter gets no update, no weight
    decay and no optimizer state); each appears exactly once. Empty groups are dropped. Every group
    carries ``"name"``, ``"weight_decay"``, ``"lars_exclude"``, ``"apply_wd"`` (whether a weight-decay
    schedule, :func:`~sslkit.optim.set_weight_decay`, may change it: True for decay groups) and
    ``"lr_scale"``.

    A model with :func:`param_owners` (several students) gets each owner's groups apart, named
    ``<prefix><group>``, carrying ``"owner"`` and the owner's learning-rate scale multiplied into ``"lr_scale"``:
    one optimizer over students whose losses are independent is the same as one per student (Adam's and SGD's
    updates are per parameter), and the update clips each owner's gradients alone.
    """
    skip = no_decay_names(model) if exclude_bias_and_norm else set()
    scales = layer_scales(model, layer_decay, patch_embed_lr_mult) if (layer_decay != 1.0 or
                                                                         patch_embed_lr_mult != 1.0) else {}
    if trunk_lr_mult != 1.0:
        for name, _ in model.named_parameters():
            if in_trunk(name):
                scales[name] = scales.get(name, 1.0) * trunk_lr_mult
    owners = param_owners(model)
    buckets: dict[tuple[str, bool, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = not (exclude_bias_and_norm and (p.ndim <= 1 or name in skip))
        owner = next((prefix for prefix in owners if name.startswith(prefix)), "")
        buckets.setdefault((owner, decays, scales.get(name, 1.0)), []).append(p)

    scaled = bool(scales)
    groups: list[dict[str, Any]] = []
    order = list(owners) + [""]
    for (owner, decays, scale), params in sorted(buckets.items(),
                                                 key=lambda kv: (order.index(kv[0][0]), not kv[0][1], -kv[0][2])):
        name = "decay" if decays else "no_decay"
        group = {
            "name": owner + (f"{name}@{scale:.6g}" if scaled else name),
            "params": params,
            "weight_decay": float(weight_decay) if decays else 0.0,
            "lars_exclude": not decays,
            "apply_wd": decays,
            "lr_scale": float(scale) * owners.get(owner, 1.0),
        }
        if owners:
            group["owner"] = owner.rstrip(".")
        groups.append(group)
    return groups


def param_owners(model: nn.Module) -> dict[str, float]:
    """The parts of ``model`` that own their parameters apart (a distillation's students): ``model.param_owners()``
    gives each one's parameter-name prefix and learning-rate scale; empty for other models."""
    owners = getattr(model, "param_owners", None)
    return dict(owners()) if callable(owners) else {}
