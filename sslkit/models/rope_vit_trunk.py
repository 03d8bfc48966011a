"""timm's DINOv3 ViT (``Eva`` with rotary position embeddings, register tokens and LayerScale) as an sslkit
:class:`~sslkit.models.tokens.TokenTrunk`."""

from __future__ import annotations

import copy
from typing import Any

import timm
import torch
from timm.models.eva import Eva

from sslkit.models.tokens import TimmTokenTrunk, key_padding_bias

__all__ = ["RopeViTTrunk"]


class RopeViTTrunk(TimmTokenTrunk, Eva):
    """One of timm's DINOv3 architectures (``vit_small_patch16_dinov3``, ...) as an sslkit trunk.

    It *is* timm's model: :meth:`build` makes it with ``timm.create_model`` and gives it these methods, so its
    parameters carry timm's names and ``sslkit export`` writes a state dict that ``timm.create_model(arch,
    **kwargs)`` loads with ``strict=True`` (:meth:`timm_spec`). Position comes from rotary embeddings of each
    patch's coordinates (no learned table: any crop size that is a multiple of the patch), which timm jitters,
    shifts and rescales in training when the ``rope_*_coords`` arguments are given (DINOv3's RoPE augmentation,
    drawn from torch's generator). ``forward(x)`` is timm's pooled output; :meth:`forward_tokens` the tokens, with
    masked patches replaced by the mask token (iBOT, DINOv2, DINOv3) or only the ``keep`` ones encoded (MAE,
    I-JEPA), their rotary embeddings gathered with them.
    """

    @classmethod
    def build(cls, arch: str, *, in_chans: int, img_size: int, pool: str = "cls", **kwargs: Any) -> RopeViTTrunk:
        """timm's ``arch`` for ``in_chans``-channel images of ``img_size`` px, pooled by its CLS token (``cls``, as
        DINOv3) or the mean patch token (``avg``); other keyword arguments go to timm (``patch_size``, ``depth``,
        ``num_heads``, ``drop_path_rate``, ``rope_jitter_coords``, ...)."""
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be cls or avg, got {pool!r}")
        spec = {"num_classes": 0, "global_pool": "token" if pool == "cls" else "avg", "in_chans": in_chans,
                "img_size": img_size, **kwargs}
        model = timm.create_model(arch, pretrained=False, **spec)
        if not isinstance(model, Eva) or model.rope is None or not model.dynamic_img_size:
            raise ValueError(f"{arch} is not one of timm's RoPE ViTs with dynamic image sizes")
        model.__class__ = cls  # the same object and parameters, with the trunk interface added
        trunk: RopeViTTrunk = model  # type: ignore[assignment]
        trunk.out_dim = int(model.embed_dim)
        trunk.pool_kind = pool
        trunk.register_parameter("mask_token", None)
        # drop path and the RoPE augmentation change training only, not the function timm rebuilds
        kept = {k: v for k, v in spec.items() if k != "drop_path_rate" and not k.startswith("rope_")}
        trunk._timm = (arch, kept)
        return trunk

    # ------------------------------------------------------------------------------------------ shape
    @property
    def num_registers(self) -> int:
        """Register (storage) tokens."""
        return int(self.num_prefix_tokens) - 1

    # ---------------------------------------------------------------------------------------- forward
    def rope_embed(self, h: int, w: int) -> torch.Tensor:
        """timm's rotary embedding of an ``h`` x ``w`` patch grid ([h * w, E], augmented in training), on the
        trunk's device without a host-device sync.

        timm builds the coordinates on the host (and draws their augmentation from the CPU generator) and copies
        them to the device with a blocking copy: on CUDA a sync in every forward. There the embedding is computed
        by a host copy of the RoPE module (its ``periods`` are fixed by the architecture, not learned or saved) and
        sent from pinned memory without waiting: timm's function and random draws, computed on the host."""
        if self.rope.periods.device.type == "cpu":
            return self.rope.get_embed(shape=(h, w))
        return self._rope_from_host(h, w)

    @torch.compiler.disable
    def _rope_from_host(self, h: int, w: int) -> torch.Tensor:
        host = self.__dict__.get("_host_rope")
        if host is None:  # built once, kept out of the module tree (no state dict entry, not moved by .to)
            host = self.__dict__["_host_rope"] = copy.deepcopy(self.rope).to("cpu")
        host.train(self.rope.training)
        return host.get_embed(shape=(h, w)).pin_memory().to(self.rope.periods.device, non_blocking=True)

    def encode(self, x: torch.Tensor, keep: torch.Tensor | None, mask: torch.Tensor | None,
               keep_valid: torch.Tensor | None) -> torch.Tensor:
        """Every output token after the final norm: each patch's rotary embedding (timm's, of its coordinates on
        this input's grid; augmented in training) goes with it into every block's attention."""
        tokens, h, w = self.patch_embeddings(x, mask)
        b, d = tokens.shape[0], tokens.shape[-1]
        rope = self.rope_embed(h, w)  # [N, E]: one row per patch, raster order
        if keep is not None:
            tokens = tokens.gather(1, keep[..., None].expand(-1, -1, d))
            rope = rope[keep][:, None]  # [B, 1, K, .]: each image's kept patches' embeddings
        tokens = self.norm_pre(self.pos_drop(self.with_prefix(tokens)))
        bias = None
        if keep_valid is not None:
            prefix = keep_valid.new_ones(b, tokens.shape[1] - keep_valid.shape[1])
            bias = key_padding_bias(torch.cat([prefix, keep_valid], dim=1), tokens.dtype)
        for block in self.blocks:
            tokens = block(tokens, rope=rope, attn_mask=bias)
        return self.norm(tokens)

    def last_block_tokens(self, x: torch.Tensor, last_n: int) -> list[torch.Tensor]:
        """Every token of the last ``last_n`` blocks' outputs, each through the final norm, oldest first."""
        tokens = self.patch_embed(x)
        b, h, w, d = tokens.shape
        rope = self.rope_embed(h, w)
        tokens = self.norm_pre(self.pos_drop(self.with_prefix(tokens.reshape(b, h * w, d))))
        outs = []
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, rope=rope)
            if i >= len(self.blocks) - last_n:
                outs.append(self.norm(tokens))
        return outs
