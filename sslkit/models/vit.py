"""ViT trunks: timm's VisionTransformer behind sslkit's trunk interface, with token outputs and masking."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from sslkit.registry import register_trunk

__all__ = [
    "FEATURE_KINDS",
    "VIT_SIZES",
    "Tokens",
    "ViTTrunk",
    "build_vit",
    "check_vit_kwargs",
    "key_padding_bias",
    "patch_grid_errors",
    "pos_embed_on_grid",
    "resample_matrix",
    "sincos_pos_embed",
]

#: sslkit's ViT sizes: (embed_dim, depth, num_heads, timm architecture of that shape).
VIT_SIZES: dict[str, tuple[int, int, int, str]] = {
    "vit_tiny": (192, 12, 3, "vit_tiny_patch16_224"),
    "vit_small": (384, 12, 6, "vit_small_patch16_224"),
    "vit_base": (768, 12, 12, "vit_base_patch16_224"),
    "vit_large": (1024, 24, 16, "vit_large_patch16_224"),
}

#: The features an evaluation may read from a ViT (``eval.vit_features``): the trunk's own pooling, the CLS
#: token, the mean of the patch tokens, both concatenated, or DINO's CLS tokens of the last n blocks.
FEATURE_KINDS = ("pool", "cls", "avg", "cls+avg", "cls_last_n")

#: VisionTransformer arguments sslkit sets itself (the trunk interface depends on them); a user gives the
#: sslkit name in brackets instead, where there is one.
_CONTROLLED = {
    "num_classes": None, "global_pool": "pool", "class_token": None, "no_embed_class": None, "fc_norm": None,
    "dynamic_img_size": None, "init_values": "layer_scale_init", "in_chans": None, "img_size": None,
    "patch_size": None, "pos_embed": None, "reg_tokens": None, "drop_path_rate": None, "qk_norm": None,
    "weight_init": None, "embed_layer": None, "block_fn": None, "mlp_layer": None, "attn_layer": None,
    "norm_layer": None, "act_layer": None, "embed_norm_layer": None, "device": None, "dtype": None,
}


@dataclass
class Tokens:
    """A ViT's output tokens for one batch, after the final norm.

    * ``cls``: ``[B, D]`` the CLS token;
    * ``registers``: ``[B, R, D]`` the register tokens (``R = reg_tokens``, 0 by default);
    * ``patches``: ``[B, n, D]`` the patch tokens: all ``N = h * w`` of them in raster order, or, when the
      encoder dropped patches (``keep``), the ``K`` kept ones in the order of ``keep``;
    * ``grid``: ``(h, w)``, the patch grid of the input;
    * ``keep``: ``[B, K]`` the raster indices of the patches the encoder saw, or None (all of them).
    """

    cls: torch.Tensor
    registers: torch.Tensor
    patches: torch.Tensor
    grid: tuple[int, int]
    keep: torch.Tensor | None = None


def sincos_pos_embed(dim: int, grid: tuple[int, int]) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings ``[h * w, dim]`` (MAE, MoCo v3), raster order.

    The patch in row ``i``, column ``j`` gets ``[sin(j w), cos(j w), sin(i w), cos(i w)]`` with the
    frequencies ``w_k = 10000 ** (-k / (dim / 4))``, ``k < dim / 4``: the column half first, as MAE's
    ``get_2d_sincos_pos_embed``. ``dim`` must be a multiple of 4. Computed in float64, returned as float32.
    """
    if dim % 4:
        raise ValueError(f"sin-cos position embeddings need an embedding size divisible by 4, got {dim}")
    h, w = grid
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows = torch.arange(h, dtype=torch.float64).repeat_interleave(w)  # i of each patch, raster order
    cols = torch.arange(w, dtype=torch.float64).repeat(h)  # j
    a, b = cols[:, None] * omega, rows[:, None] * omega
    return torch.cat([a.sin(), a.cos(), b.sin(), b.cos()], dim=1).float()


def resample_matrix(old: tuple[int, int], new: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The ``[new_h * new_w, old_h * old_w]`` matrix of timm's position-embedding resampling.

    ``timm.layers.resample_abs_pos_embed`` resizes the embedding grid with bicubic interpolation
    (antialiased, float32). That map is linear, so it is this matrix, made by interpolating the identity;
    applying it is a matmul, whose backward is deterministic on CUDA, where ``upsample_bicubic2d``'s
    backward raises under ``torch.use_deterministic_algorithms(True)`` (``machine.deterministic``).
    """
    n = old[0] * old[1]
    eye = torch.eye(n, device=device, dtype=torch.float32).reshape(n, 1, *old)
    with torch.no_grad():
        out = F.interpolate(eye, size=new, mode="bicubic", antialias=True, align_corners=False)
    return out.reshape(n, new[0] * new[1]).T.contiguous()


def pos_embed_on_grid(pos_embed: torch.Tensor, base: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """Position embeddings ``[1, h * w, D]`` made for the ``base`` grid, for another ``grid``: as they are on the base
    grid, else resampled by :func:`resample_matrix` (in float32, back to their dtype)."""
    if tuple(grid) == tuple(base):
        return pos_embed
    matrix = resample_matrix(tuple(base), tuple(grid), pos_embed.device)  # type: ignore[arg-type]
    with torch.autocast(pos_embed.device.type, enabled=False):
        return (matrix @ pos_embed[0].float()).to(pos_embed.dtype)[None]


def key_padding_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, 1, L]`` additive attention bias from ``valid`` ``[B, L]``: 0 on valid keys, ``-inf`` on padding (the
    padding is left out as a key; every query keeps its row)."""
    bias = torch.zeros(valid.shape, device=valid.device, dtype=dtype)
    return bias.masked_fill(~valid, float("-inf"))[:, None, None, :]


class ViTTrunk(VisionTransformer):
    """timm's :class:`~timm.models.vision_transformer.VisionTransformer` as an sslkit trunk.

    It *is* timm's model (a subclass that adds methods, not a fork): its parameters carry timm's names
    (``patch_embed.proj.weight``, ``blocks.3.attn.qkv.weight``, ...), so ``sslkit export`` writes a state
    dict that ``timm.create_model(arch, num_classes=0, **kwargs)`` loads with ``strict=True``
    (:meth:`timm_spec`). sslkit fixes a few of timm's choices:

    * a CLS token, no classifier (``num_classes=0``), position embeddings for the patches only
      (``no_embed_class``: CLS and register tokens get none, as in DeiT III and DINOv2's registers);
    * the final norm on every token and ``pool`` = ``cls`` (the CLS token) or ``avg`` (the mean of the
      patch tokens after that norm: timm's ``global_pool='avg', fc_norm=False``);
    * any input size that is a multiple of the patch size (``dynamic_img_size``: multi-crop), with the
      position embeddings of other grids resampled as timm does (bicubic), but by a matmul
      (:func:`resample_matrix`), whose backward is deterministic on CUDA;
    * ``pos_embed='sincos'``: fixed 2-D sine-cosine embeddings (a parameter with ``requires_grad=False``,
      as MAE and MoCo v3), else learned ones.

    ``forward(x)`` is timm's: the pooled features ``[B, embed_dim]`` (``out_dim``). :meth:`forward_tokens`
    gives the CLS, register and patch tokens (:class:`Tokens`) and applies a mask, by dropping patches
    (``keep``: MAE, I-JEPA's context) or replacing them with a learned mask token (``mask``: iBOT, DINOv2,
    SimMIM; :meth:`enable_mask_token` adds it). :meth:`features` gives the features evaluation protocols
    read, :meth:`layer_id` the layer of a parameter for layer-wise learning-rate decay.
    """

    #: The trunk gives patch tokens (methods that need them check for this).
    patch_tokens = True

    def __init__(
        self,
        *,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        reg_tokens: int = 0,
        drop_path_rate: float = 0.0,
        layer_scale_init: float | None = None,
        qk_norm: bool = False,
        pos_embed: str = "learned",
        pool: str = "cls",
        weight_init: str = "",
        arch: str = "",
        **timm_kwargs: Any,
    ) -> None:
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be cls or avg, got {pool!r}")
        if pos_embed not in ("learned", "sincos"):
            raise ValueError(f"pos_embed must be learned or sincos, got {pos_embed!r}")
        spec = dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
                    num_heads=num_heads, reg_tokens=reg_tokens, drop_path_rate=drop_path_rate,
                    init_values=layer_scale_init, qk_norm=qk_norm, weight_init=weight_init, **timm_kwargs)
        super().__init__(num_classes=0, global_pool="token" if pool == "cls" else "avg", class_token=True,
                         no_embed_class=True, fc_norm=False, dynamic_img_size=True, **spec)
        self.out_dim = embed_dim
        self.pool_kind = pool
        self.pos_embed_kind = pos_embed
        if pos_embed == "sincos":
            with torch.no_grad():
                self.pos_embed.copy_(sincos_pos_embed(embed_dim, self.patch_embed.grid_size)[None])
            self.pos_embed.requires_grad_(False)
        self.register_parameter("mask_token", None)
        # what timm needs to build this very network (sslkit export, encoder.json): drop_path and weight_init
        # change training only, not the function
        timm_spec = {k: v for k, v in spec.items() if k not in ("drop_path_rate", "weight_init")}
        self._timm = (arch, {"num_classes": 0, "global_pool": "token" if pool == "cls" else "avg",
                             "class_token": True, "no_embed_class": True, "fc_norm": False,
                             "dynamic_img_size": True, **timm_spec})

    # ------------------------------------------------------------------------------------------ shape
    @property
    def patch_size(self) -> int:
        """The side of a (square) patch in pixels."""
        return int(self.patch_embed.patch_size[0])

    @property
    def num_registers(self) -> int:
        """Register tokens (``reg_tokens``)."""
        return int(self.num_reg_tokens)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid of an input of ``height`` x ``width`` pixels."""
        return height // self.patch_size, width // self.patch_size

    def timm_spec(self) -> tuple[str, dict[str, Any]]:
        """``(architecture, kwargs)`` such that ``timm.create_model(arch, **kwargs)`` is this network."""
        arch, kwargs = self._timm
        return arch, dict(kwargs)

    # ------------------------------------------------------------------------------------- embeddings
    def pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor:
        """Position embeddings ``[1, h * w, D]`` of the patches of a ``grid``: the trunk's own for its input
        size, resampled for other sizes (:func:`resample_matrix`)."""
        return pos_embed_on_grid(self.pos_embed, tuple(self.patch_embed.grid_size), grid)  # type: ignore[arg-type]

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """timm's hook: ``[B, h, w, D]`` patch embeddings -> prefix tokens + patches with positions."""
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d) + self.pos_embed_for((h, w))
        return self.pos_drop(self._with_prefix(x))

    def _with_prefix(self, x: torch.Tensor) -> torch.Tensor:
        prefix = [self.cls_token.expand(x.shape[0], -1, -1)]
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(x.shape[0], -1, -1))
        return torch.cat([*prefix, x], dim=1)

    def enable_mask_token(self) -> None:
        """Add the learned mask token that :meth:`forward_tokens` puts in place of masked patches (iBOT, DINOv2,
        SimMIM). A method's model builder calls it, before the optimizer is made. Zero-initialised, as
        DINOv2's and iBOT's."""
        if self.mask_token is None:
            self.mask_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim, device=self.cls_token.device,
                                                       dtype=self.cls_token.dtype))

    # ---------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                keep_valid: torch.Tensor | None = None, tokens: bool = False) -> torch.Tensor:
        """timm's forward, the pooled features ``[B, D]``; with ``tokens=True`` or a mask, every output token
        ``[B, 1 + R + n, D]`` instead (:meth:`forward_tokens` splits them). One entry point, so
        ``machine.compile`` (``Module.compile``) compiles the masked forward too."""
        if not tokens and keep is None and mask is None and keep_valid is None:
            return super().forward(x)
        return self._tokens(x, keep, mask, keep_valid)

    def forward_tokens(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       keep_valid: torch.Tensor | None = None) -> Tokens:
        """The tokens of images ``x`` ``[B, C, H, W]``, optionally masked.

        ``mask`` ``[B, N]`` (bool, True = masked, raster order over the ``N`` patches): the embeddings of the
        masked patches are replaced by the mask token before the position embeddings are added, so every
        patch keeps its position. ``keep`` ``[B, K]`` (long): only these patches enter the encoder, gathered
        after the position embeddings (``K`` is fixed, so the shapes are); ``keep_valid`` ``[B, K]`` (bool) marks
        the entries of ``keep`` that are padding (False): they are left out of attention (an additive mask of
        ``-inf`` on their keys), so the other tokens are those of the real patches alone. Without any of them
        this is timm's ``forward_features`` split into CLS, registers and patches.
        """
        out = self(x, keep=keep, mask=mask, keep_valid=keep_valid, tokens=True)
        r = 1 + self.num_registers
        grid = self.grid(x.shape[-2], x.shape[-1])
        return Tokens(cls=out[:, 0], registers=out[:, 1:r], patches=out[:, r:], grid=grid, keep=keep)

    def _tokens(self, x: torch.Tensor, keep: torch.Tensor | None, mask: torch.Tensor | None,
                keep_valid: torch.Tensor | None) -> torch.Tensor:
        tokens = self.patch_embed(x)  # [B, h, w, D] (dynamic_img_size)
        b, h, w, d = tokens.shape
        tokens = tokens.reshape(b, h * w, d)
        if mask is not None:
            if self.mask_token is None:
                raise RuntimeError("this ViT has no mask token: the model builder of a method that replaces masked "
                                   "patches must call trunk.enable_mask_token()")
            tokens = torch.where(mask[..., None], self.mask_token.to(tokens.dtype), tokens)
        tokens = tokens + self.pos_embed_for((h, w))
        if keep is not None:
            tokens = tokens.gather(1, keep[..., None].expand(-1, -1, d))
        tokens = self.norm_pre(self.patch_drop(self.pos_drop(self._with_prefix(tokens))))
        if keep_valid is None:
            tokens = self.blocks(tokens)
        else:
            prefix = keep_valid.new_ones(b, tokens.shape[1] - keep_valid.shape[1])
            valid = torch.cat([prefix, keep_valid], dim=1)
            bias = key_padding_bias(valid, tokens.dtype)
            for block in self.blocks:
                tokens = block(tokens, attn_mask=bias)
        return self.norm(tokens)

    def pool_tokens(self, tokens: Tokens) -> torch.Tensor:
        """The trunk's features ``[B, D]`` from its tokens: the CLS token, or the mean of the patch tokens."""
        return tokens.cls if self.pool_kind == "cls" else tokens.patches.mean(dim=1)

    def features(self, x: torch.Tensor, kind: str = "pool", last_n: int = 4) -> torch.Tensor:
        """The features an evaluation protocol reads (``eval.vit_features``):

        * ``pool``: the trunk's own output (its ``pool``); ``cls``: the CLS token; ``avg``: the mean of the
          patch tokens; ``cls+avg``: both, concatenated ``[B, 2D]``;
        * ``cls_last_n``: the CLS tokens of the last ``last_n`` blocks, each through the final norm, oldest
          first ``[B, n D]`` (DINO's linear evaluation of ViT-S: ``n_last_blocks=4``).
        """
        if kind == "cls_last_n":
            if not 1 <= last_n <= len(self.blocks):
                raise ValueError(f"last_n must be in [1, {len(self.blocks)}] (the blocks of this ViT), got {last_n}")
            tokens = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
            outs = []
            for i, block in enumerate(self.blocks):
                tokens = block(tokens)
                if i >= len(self.blocks) - last_n:
                    outs.append(self.norm(tokens)[:, 0])
            return torch.cat(outs, dim=1)
        t = self.forward_tokens(x)
        if kind == "pool":
            return self.pool_tokens(t)
        if kind == "cls":
            return t.cls
        if kind == "avg":
            return t.patches.mean(dim=1)
        if kind == "cls+avg":
            return torch.cat([t.cls, t.patches.mean(dim=1)], dim=1)
        raise ValueError(f"unknown ViT feature kind {kind!r}: use one of {', '.join(FEATURE_KINDS)}")

    # ------------------------------------------------------------------------------------ optimisation
    def no_weight_decay_names(self) -> set[str]:
        """Parameters (by name in this module) that get no weight decay whatever their shape: the position
        embeddings and the CLS, register and mask tokens (1-d parameters, biases, norms and LayerScale gammas,
        are excluded by their shape)."""
        return {"pos_embed", "cls_token", "reg_token", "mask_token"}

    @property
    def num_layers(self) -> int:
        """Layers of layer-wise learning-rate decay: the embedding (0), one per block, and the top."""
        return len(self.blocks) + 1

    def layer_id(self, name: str) -> int:
        """The layer of parameter ``name`` (relative to this module) for layer-wise lr decay, the BEiT / MAE /
        DINOv2 rule: the embedding (patch embedding, position embeddings, CLS, register and mask tokens) is
        layer 0, block ``i`` layer ``i + 1``, the rest (the final norm) layer :attr:`num_layers`."""
        if name.split(".")[0] in ("cls_token", "reg_token", "pos_embed", "mask_token", "patch_embed"):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return self.num_layers


def check_vit_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """Problems with a ViT's ``model.trunk_kwargs``: a key sslkit sets itself, or one that neither sslkit's
    builder nor timm's ``VisionTransformer`` has (with the closest names)."""
    from sslkit.suggest import did_you_mean

    ours = [p for p in inspect.signature(build_vit).parameters if p not in ("size", "in_channels", "timm_kwargs")]
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
    """A :class:`ViTTrunk` of ``size`` (:data:`VIT_SIZES`), ``depth`` and ``num_heads`` overridable (a shallower
    ViT for a CPU). ``layer_scale_init`` is timm's ``init_values`` (LayerScale; DINOv2 1e-5, off by default);
    ``weight_init`` is timm's (``''``, ``moco``, ``jax``); other ``VisionTransformer`` arguments
    (``mlp_ratio``, ``qkv_bias``, ...) pass through to timm."""
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

