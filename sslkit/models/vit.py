"""ViT trunks by name: sslkit's sizes registered as trunks, their keyword checks, and the patch-grid rules.

Light to import (no timm): naming or checking a ViT in a config imports nothing heavy; building one imports
:mod:`sslkit.models.vit_trunk` (timm's VisionTransformer).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sslkit.registry import register_trunk

if TYPE_CHECKING:
    from sslkit.models.vit_trunk import ViTTrunk

__all__ = ["VIT_SIZES", "build_vit", "check_vit_kwargs", "patch_grid_errors"]

#: sslkit's ViT sizes: (embed_dim, depth, num_heads, timm architecture of that shape).
VIT_SIZES: dict[str, tuple[int, int, int, str]] = {
    "vit_tiny": (192, 12, 3, "vit_tiny_patch16_224"),
    "vit_small": (384, 12, 6, "vit_small_patch16_224"),
    "vit_base": (768, 12, 12, "vit_base_patch16_224"),
    "vit_large": (1024, 24, 16, "vit_large_patch16_224"),
}

#: VisionTransformer arguments sslkit sets itself (the trunk interface depends on them); a user gives the
#: sslkit name in brackets instead, where there is one.
_CONTROLLED = {
    "num_classes": None, "global_pool": "pool", "class_token": None, "no_embed_class": None, "fc_norm": None,
    "dynamic_img_size": None, "init_values": "layer_scale_init", "in_chans": None, "img_size": None,
    "patch_size": None, "pos_embed": None, "reg_tokens": None, "drop_path_rate": None, "qk_norm": None,
    "weight_init": None, "embed_layer": None, "block_fn": None, "mlp_layer": None, "attn_layer": None,
    "norm_layer": None, "act_layer": None, "embed_norm_layer": None, "device": None, "dtype": None,
}


def check_vit_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """Problems with a ViT's ``model.trunk_kwargs``: a key sslkit sets itself, or one that neither sslkit's
    builder nor timm's ``VisionTransformer`` has (with the closest names)."""
    from sslkit.errors import did_you_mean

    ours = [p for p in inspect.signature(build_vit).parameters if p not in ("size", "in_channels", "timm_kwargs")]
    timm_names: list[str] = []
    if set(kwargs) - set(ours) - set(_CONTROLLED):  # timm's own arguments: read from timm (a second's import)
        from timm.models.vision_transformer import VisionTransformer

        timm_names = [p for p in inspect.signature(VisionTransformer.__init__).parameters if p != "self"]
    errors = []
    for key, value in kwargs.items():
        if key in ours:
            if key == "pool" and value not in ("cls", "avg"):
                errors.append(f"'model.trunk_kwargs.pool' must be cls or avg, got {value!r}")
            if key == "pos_embed" and value not in ("learned", "sincos"):
                errors.append(f"'model.trunk_kwargs.pos_embed' must be learned or sincos, got {value!r}")
            continue
        if key in _CONTROLLED:
            instead = _CONTROLLED[key]
            errors.append(f"'model.trunk_kwargs.{key}' is set by sslkit for its ViT trunks"
                          + (f": use model.trunk_kwargs.{instead}" if instead else " (docs/vit.md)"))
        elif key not in timm_names:
            errors.append(f"'model.trunk_kwargs.{key}' is not an argument of sslkit's ViT nor of timm's "
                          f"VisionTransformer.{did_you_mean(key, ours + timm_names)} sslkit's: {', '.join(ours)}; "
                          "any other VisionTransformer argument is passed to timm.")
    return errors


def build_vit(
    size: str,
    in_channels: int = 3,
    img_size: int = 224,
    patch_size: int = 16,
    reg_tokens: int = 0,
    drop_path_rate: float = 0.0,
    layer_scale_init: float | None = None,
    qk_norm: bool = False,
    pos_embed: str = "learned",
    pool: str = "cls",
    depth: int | None = None,
    num_heads: int | None = None,
    weight_init: str = "",
    **timm_kwargs: Any,
) -> ViTTrunk:
    """A :class:`~sslkit.models.vit_trunk.ViTTrunk` of ``size`` (:data:`VIT_SIZES`), ``depth`` and ``num_heads``
    overridable (a shallower ViT for a CPU). ``layer_scale_init`` is timm's ``init_values`` (LayerScale; DINOv2
    1e-5, off by default); ``weight_init`` is timm's (``''``, ``moco``, ``jax``); other ``VisionTransformer``
    arguments (``mlp_ratio``, ``qkv_bias``, ...) pass through to timm."""
    from sslkit.models.vit_trunk import ViTTrunk  # (timm: imported when a ViT is built, not when one is named)

    dim, default_depth, default_heads, arch = VIT_SIZES[size]
    return ViTTrunk(img_size=img_size, patch_size=patch_size, in_chans=in_channels, embed_dim=dim,
                    depth=depth or default_depth, num_heads=num_heads or default_heads, reg_tokens=reg_tokens,
                    drop_path_rate=drop_path_rate, layer_scale_init=layer_scale_init, qk_norm=qk_norm,
                    pos_embed=pos_embed, pool=pool, weight_init=weight_init, arch=arch, **timm_kwargs)


def _register(size: str) -> None:
    """Register ``build_vit`` for ``size`` under its name: its arguments are build_vit's after ``size``."""
    dim, depth, heads, arch = VIT_SIZES[size]
    builder = functools.partial(build_vit, size)
    builder.__name__ = f"build_{size}"  # type: ignore[attr-defined]
    builder.__doc__ = (f"timm's ViT of {size.split('_')[1]} width ({dim}-d tokens, {depth} blocks of {heads} heads; "
                       f"timm {arch}) as a trunk: :func:`build_vit`.")
    builder.check_kwargs = check_vit_kwargs  # type: ignore[attr-defined]
    builder.patch_tokens = True  # type: ignore[attr-defined]
    register_trunk(size)(builder)


for _size in VIT_SIZES:
    _register(_size)


def patch_grid_errors(patch: int, sizes: Sequence[tuple[str, int]]) -> list[str]:
    """Config errors for crop sizes a ViT of patch size ``patch`` cannot take: ``(key, pixels)`` pairs."""
    errors = []
    for key, pixels in sizes:
        if pixels < patch:
            errors.append(f"'{key}' = {pixels} is smaller than one patch (model.trunk_kwargs.patch_size / "
                          f"data.patch_size = {patch}): raise the crop size or lower the patch size")
        elif pixels % patch:
            fits = [p for p in range(min(patch, pixels), 0, -1) if pixels % p == 0][:3]
            errors.append(f"'{key}' = {pixels} is not a multiple of the ViT's patch size {patch} "
                          f"(model.trunk_kwargs.patch_size / data.patch_size): use a crop size that is (e.g. "
                          f"{pixels - pixels % patch or patch}) or a patch size that divides it "
                          f"({', '.join(map(str, fits))})")
    return errors

