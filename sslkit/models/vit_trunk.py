"""The ViT trunk: timm's VisionTransformer as an sslkit trunk (token outputs, masking, resampled positions).

Imported only when a ViT is built (:func:`sslkit.models.vit.build_vit`): timm's import takes about a second.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer

from sslkit.models.tokens import (
    TimmTokenTrunk,
    key_padding_bias,
    pos_embed_on_grid,
    sincos_pos_embed,
)

__all__ = ["ViTTrunk"]


class ViTTrunk(TimmTokenTrunk, VisionTransformer):
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
    def num_registers(self) -> int:
        """Register tokens (``reg_tokens``)."""
        return int(self.num_reg_tokens)

    # ------------------------------------------------------------------------------------- embeddings
    def pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor:
        """Position embeddings ``[1, h * w, D]`` of the patches of a ``grid``: the trunk's own for its input
        size, resampled for other sizes (:func:`resample_matrix`)."""
        return pos_embed_on_grid(self.pos_embed, self.base_grid, grid)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """timm's hook: ``[B, h, w, D]`` patch embeddings -> prefix tokens + patches with positions."""
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d) + self.pos_embed_for((h, w))
        return self.pos_drop(self.with_prefix(x))

    # ---------------------------------------------------------------------------------------- forward
    def encode(self, x: torch.Tensor, keep: torch.Tensor | None, mask: torch.Tensor | None,
               keep_valid: torch.Tensor | None) -> torch.Tensor:
        """Every output token after the final norm: the position table (resampled to this input's grid) added to
        the patch embeddings before the kept ones are gathered."""
        tokens, h, w = self.patch_embeddings(x, mask)
        b, d = tokens.shape[0], tokens.shape[-1]
        tokens = tokens + self.pos_embed_for((h, w))
        if keep is not None:
            tokens = tokens.gather(1, keep[..., None].expand(-1, -1, d))
        tokens = self.norm_pre(self.patch_drop(self.pos_drop(self.with_prefix(tokens))))
        if keep_valid is None:
            tokens = self.blocks(tokens)
        else:
            prefix = keep_valid.new_ones(b, tokens.shape[1] - keep_valid.shape[1])
            valid = torch.cat([prefix, keep_valid], dim=1)
            bias = key_padding_bias(valid, tokens.dtype)
            for block in self.blocks:
                tokens = block(tokens, attn_mask=bias)
        return self.norm(tokens)

    def last_block_tokens(self, x: torch.Tensor, last_n: int) -> list[torch.Tensor]:
        """Every token of the last ``last_n`` blocks' outputs, each through the final norm, oldest first."""
        tokens = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        outs = []
        for i, block in enumerate(self.blocks):
            tokens = block(tokens)
            if i >= len(self.blocks) - last_n:
                outs.append(self.norm(tokens))
        return outs
