"""timm's DINOv3 ViTs by name (``model.trunk=vit_small_patch16_dinov3``, ...): registered as trunks, their keyword
checks. Light to import (no timm): building one imports :mod:`sslkit.models.rope_vit_trunk`."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from sslkit.registry import register_trunk

if TYPE_CHECKING:
    from sslkit.models.rope_vit_trunk import RopeViTTrunk

__all__ = ["DINOV3_ARCHS", "build_rope_vit", "check_rope_vit_kwargs"]

#: timm's DINOv3 architectures (timm >= 1.0.20): rotary position embeddings, 4 register tokens, LayerScale; the
#: ``_qkvb`` ones with a bias in the attention's qkv projection, as some of Meta's released weights.
DINOV3_ARCHS: tuple[str, ...] = tuple(
    f"vit_{size}_patch16_dinov3{variant}" for size in ("small", "small_plus", "base", "large", "huge_plus")
    for variant in ("", "_qkvb")) + ("vit_7b_patch16_dinov3",)

#: Eva arguments sslkit sets itself (the trunk interface depends on them).
_CONTROLLED = ("num_classes", "global_pool", "in_chans", "img_size", "dynamic_img_size", "class_token",
               "use_rot_pos_emb", "use_abs_pos_emb", "rope_type", "use_fc_norm", "device", "dtype")


def build_rope_vit(arch: str, in_channels: int = 3, img_size: int = 224, patch_size: int = 16, pool: str = "cls",
                   drop_path_rate: float = 0.0, **timm_kwargs: Any) -> RopeViTTrunk:
    """timm's DINOv3 ``arch`` as a :class:`~sslkit.models.rope_vit_trunk.RopeViTTrunk`: ``pool`` ``cls`` (DINOv3's)
    or ``avg``; ``patch_size``, ``depth``, ``num_heads`` and every other ``Eva`` argument (``rope_jitter_coords``,
    ``rope_rescale_coords``, ``rope_shift_coords``: DINOv3's RoPE augmentation) pass to timm."""
    from sslkit.models.rope_vit_trunk import RopeViTTrunk  # (timm: imported when one is built)

    return RopeViTTrunk.build(arch, in_chans=in_channels, img_size=img_size, pool=pool, patch_size=patch_size,
                              drop_path_rate=drop_path_rate, **timm_kwargs)


def check_rope_vit_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """Problems with a DINOv3 ViT's ``model.trunk_kwargs``: a key sslkit sets itself, a pool other than cls or
    avg, or a key timm's ``Eva`` does not take (with the closest names)."""
    from sslkit.errors import did_you_mean

    ours = ["img_size", "patch_size", "pool", "drop_path_rate"]
    errors = []
    timm_names: list[str] = []
    if set(kwargs) - set(ours) - set(_CONTROLLED):
        from timm.models.eva import Eva

        timm_names = [p for p in inspect.signature(Eva.__init__).parameters if p not in ("self", "kwargs")]
    for key, value in kwargs.items():
        if key == "pool" and value not in ("cls", "avg"):
            errors.append(f"'model.trunk_kwargs.pool' must be cls or avg, got {value!r}")
        elif key in _CONTROLLED:
            errors.append(f"'model.trunk_kwargs.{key}' is set by sslkit for its DINOv3 trunks (docs/vit.md)")
        elif key not in ours and key not in timm_names:
            errors.append(f"'model.trunk_kwargs.{key}' is not an argument of sslkit's DINOv3 ViT nor of timm's "
                          f"Eva.{did_you_mean(key, ours + timm_names)}")
    return errors


def _register(arch: str) -> None:
    builder = functools.partial(build_rope_vit, arch)
    builder.__name__ = f"build_{arch}"  # type: ignore[attr-defined]
    builder.__doc__ = f"timm's {arch} (DINOv3: rotary position embeddings, register tokens) as a trunk."
    builder.check_kwargs = check_rope_vit_kwargs  # type: ignore[attr-defined]
    builder.patch_tokens = True  # type: ignore[attr-defined]
    register_trunk(arch)(builder)


for _arch in DINOV3_ARCHS:
    _register(_arch)
