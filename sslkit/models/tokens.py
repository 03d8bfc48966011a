"""ViT token arithmetic without timm: the Tokens a ViT returns, the TokenTrunk interface every ViT trunk meets,
position embeddings (sine-cosine, resampled to another grid), key-padding biases, and the feature kinds an
evaluation reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FEATURE_KINDS", "TimmTokenTrunk", "TokenTrunk", "Tokens", "key_padding_bias", "pos_embed_on_grid",
           "resample_matrix", "sincos_pos_embed"]

#: The features an evaluation may read from a ViT (``eval.vit_features``): the trunk's own pooling, the CLS
#: token, the mean of the patch tokens, both concatenated, or DINO's CLS tokens of the last n blocks.
FEATURE_KINDS = ("pool", "cls", "avg", "cls+avg", "cls_last_n")


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


class TokenTrunk(nn.Module):
    """What a trunk that gives tokens meets, so that the masked and dense methods (MAE, iBOT, DINOv2, I-JEPA),
    the model's :func:`~sslkit.models.ssl_model.encode_views` and the evaluation tools read any ViT alike:
    :class:`~sslkit.models.vit_trunk.ViTTrunk` (timm's ViT) subclasses it, and so does a user's ViT-like trunk.
    ``forward(x)`` gives the pooled features ``[B, out_dim]``, as every trunk's; the methods below give the rest.
    """

    #: The trunk gives patch tokens: config validation reads this flag from a registered trunk builder (sslkit's
    #: ViT builders set it), so a TokenTrunk class registered as a trunk itself passes for the masked methods.
    patch_tokens = True
    #: The width of the features and of every token.
    out_dim: int
    #: The transformer blocks, in order (FSDP shards each, activation checkpointing wraps each).
    blocks: nn.Sequential

    @property
    def patch_size(self) -> int:
        """The side of a square patch, in pixels."""
        raise NotImplementedError(f"{type(self).__name__} must give patch_size")

    @property
    def num_registers(self) -> int:
        """The register (storage) tokens between the CLS token and the patches."""
        raise NotImplementedError(f"{type(self).__name__} must give num_registers")

    @property
    def in_channels(self) -> int:
        """The input image's channels."""
        raise NotImplementedError(f"{type(self).__name__} must give in_channels")

    @property
    def base_grid(self) -> tuple[int, int]:
        """The patch grid of the image size the trunk was built for (its position embeddings' own grid)."""
        raise NotImplementedError(f"{type(self).__name__} must give base_grid")

    @property
    def num_heads(self) -> int:
        """The attention heads of each block."""
        raise NotImplementedError(f"{type(self).__name__} must give num_heads")

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid of an input of ``height`` x ``width`` pixels."""
        return height // self.patch_size, width // self.patch_size

    def enable_mask_token(self) -> None:
        """Add the learned token that :meth:`forward_tokens` puts in place of the patches ``mask`` marks."""
        raise NotImplementedError(f"{type(self).__name__} has no mask token: it cannot train a masked method")

    def forward_tokens(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       keep_valid: torch.Tensor | None = None) -> Tokens:
        """The CLS, register and patch tokens of ``x`` after the final norm: all patches, only the ``keep``
        ones (``[B, K]`` raster indices, ``keep_valid`` marking padding), or with the ``mask``-ed ones (``[B, N]``
        bool) replaced by the mask token."""
        raise NotImplementedError(f"{type(self).__name__} must give forward_tokens")

    def pool_tokens(self, tokens: Tokens) -> torch.Tensor:
        """The trunk's features ``[B, out_dim]`` from its tokens (what ``forward`` returns)."""
        raise NotImplementedError(f"{type(self).__name__} must give pool_tokens")

    def last_block_tokens(self, x: torch.Tensor, last_n: int) -> list[torch.Tensor]:
        """Every token of the last ``last_n`` blocks' outputs, each through the final norm, oldest first (``[B, 1 +
        R + N, D]`` each; DINOv2's ``get_intermediate_layers(x, n, norm=True)``)."""
        raise NotImplementedError(f"{type(self).__name__} must give last_block_tokens for the outputs of its blocks")

    def last_cls_tokens(self, x: torch.Tensor, last_n: int) -> torch.Tensor:
        """The CLS tokens of the last ``last_n`` blocks, each through the final norm, oldest first ``[B, n D]``."""
        return torch.cat([t[:, 0] for t in self.last_block_tokens(x, last_n)], dim=1)

    def last_patch_maps(self, x: torch.Tensor, last_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled features of the final tokens ``[B, out_dim]`` and the patch tokens of the last ``last_n``
        blocks, each through the final norm, concatenated along the channels (oldest first) on the patch grid
        ``[B, h, w, n D]`` (LightlyTrain ``distillationv2``'s teacher features with ``n_teacher_blocks``), in one
        forward."""
        grid = self.grid(x.shape[-2], x.shape[-1])
        r = 1 + self.num_registers
        outs = self.last_block_tokens(x, last_n)
        last = outs[-1]
        pooled = self.pool_tokens(Tokens(cls=last[:, 0], registers=last[:, 1:r], patches=last[:, r:], grid=grid))
        maps = torch.cat([t[:, r:] for t in outs], dim=-1).reshape(x.shape[0], *grid, -1)
        return pooled, maps

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
            return self.last_cls_tokens(x, last_n)
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


class TimmTokenTrunk(TokenTrunk):
    """The :class:`TokenTrunk` parts shared by sslkit's trunks that are timm models (``ViTTrunk``: timm's
    ``VisionTransformer``; ``RopeViTTrunk``: timm's DINOv3 ``Eva``), read from the modules timm names alike:
    ``patch_embed``, ``blocks``, ``cls_token``, ``reg_token``; and the architecture timm rebuilds them from."""

    #: ``cls`` or ``avg``: what :meth:`pool_tokens` returns.
    pool_kind: str
    mask_token: nn.Parameter | None
    #: ``(architecture, kwargs)`` of ``timm.create_model`` (set by the trunk's constructor)
    _timm: tuple[str, dict[str, Any]]

    @property
    def patch_size(self) -> int:
        """The side of a (square) patch in pixels."""
        return int(self.patch_embed.patch_size[0])

    @property
    def in_channels(self) -> int:
        """The input image's channels."""
        return int(self.patch_embed.proj.in_channels)

    @property
    def base_grid(self) -> tuple[int, int]:
        """The patch grid of the trunk's ``img_size`` (a learned position table's own grid)."""
        h, w = self.patch_embed.grid_size
        return int(h), int(w)

    @property
    def num_heads(self) -> int:
        """The attention heads of each block."""
        return int(self.blocks[0].attn.num_heads)

    def timm_spec(self) -> tuple[str, dict[str, Any]]:
        """``(architecture, kwargs)`` such that ``timm.create_model(arch, **kwargs)`` is this network."""
        arch, kwargs = self._timm
        return arch, dict(kwargs)

    def enable_mask_token(self) -> None:
        """Add the learned mask token that :meth:`forward_tokens` puts in place of masked patches (iBOT, DINOv2,
        DINOv3, SimMIM). A method's model builder calls it, before the optimizer is made. Zero-initialised, as
        DINOv2's, DINOv3's and iBOT's."""
        if self.mask_token is None:
            self.mask_token = nn.Parameter(torch.zeros(1, 1, self.out_dim, device=self.cls_token.device,
                                                       dtype=self.cls_token.dtype))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                keep_valid: torch.Tensor | None = None, tokens: bool = False) -> torch.Tensor:
        """timm's forward, the pooled features ``[B, D]``; with ``tokens=True`` or a mask, every output token
        ``[B, 1 + R + n, D]`` instead (:meth:`forward_tokens` splits them). One entry point, so
        ``machine.compile`` (``Module.compile``) compiles the masked forward too. (This class comes before the timm
        class in a trunk's bases, so that ``super().forward`` is timm's.)"""
        if not tokens and keep is None and mask is None and keep_valid is None:
            return super().forward(x)
        return self.encode(x, keep, mask, keep_valid)

    def encode(self, x: torch.Tensor, keep: torch.Tensor | None, mask: torch.Tensor | None,
               keep_valid: torch.Tensor | None) -> torch.Tensor:
        """Every output token ``[B, 1 + R + n, D]`` after the final norm (:meth:`forward_tokens` says what
        ``keep``, ``mask`` and ``keep_valid`` do): the trunk's own position scheme."""
        raise NotImplementedError(f"{type(self).__name__} must give encode")

    def forward_tokens(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       keep_valid: torch.Tensor | None = None) -> Tokens:
        """The tokens of images ``x`` ``[B, C, H, W]``, optionally masked.

        ``mask`` ``[B, N]`` (bool, True = masked, raster order over the ``N`` patches): the embeddings of the
        masked patches are replaced by the mask token before positions are given, so every patch keeps its
        position. ``keep`` ``[B, K]`` (long): only these patches enter the encoder, each with its own position
        (``K`` is fixed, so the shapes are); ``keep_valid`` ``[B, K]`` (bool) marks the entries of ``keep`` that are
        padding (False): they are left out of attention (an additive mask of ``-inf`` on their keys), so the other
        tokens are those of the real patches alone. Without any of them this is timm's ``forward_features`` split
        into CLS, registers and patches. (The trunk's ``forward(..., tokens=True)`` computes them, one entry point
        for ``machine.compile``.)
        """
        out = self(x, keep=keep, mask=mask, keep_valid=keep_valid, tokens=True)
        r = 1 + self.num_registers
        grid = self.grid(x.shape[-2], x.shape[-1])
        return Tokens(cls=out[:, 0], registers=out[:, 1:r], patches=out[:, r:], grid=grid, keep=keep)

    def patch_embeddings(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
        """The patch embeddings ``[B, h w, D]`` of ``x`` (timm's ``patch_embed``, channels last), the ``mask``-ed
        ones replaced by the mask token, and the grid ``h``, ``w``."""
        tokens = self.patch_embed(x)  # [B, h, w, D] (dynamic_img_size)
        b, h, w, d = tokens.shape
        tokens = tokens.reshape(b, h * w, d)
        if mask is not None:
            if self.mask_token is None:
                raise RuntimeError("this ViT has no mask token: the model builder of a method that replaces masked "
                                   "patches must call trunk.enable_mask_token()")
            tokens = torch.where(mask[..., None], self.mask_token.to(tokens.dtype), tokens)
        return tokens, h, w

    def with_prefix(self, x: torch.Tensor) -> torch.Tensor:
        """The CLS token and the register tokens put before the patch tokens ``x`` ``[B, n, D]``."""
        prefix = [self.cls_token.expand(x.shape[0], -1, -1)]
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(x.shape[0], -1, -1))
        return torch.cat([*prefix, x], dim=1)

    def pool_tokens(self, tokens: Tokens) -> torch.Tensor:
        """The trunk's features ``[B, D]`` from its tokens: the CLS token, or the mean of the patch tokens."""
        return tokens.cls if self.pool_kind == "cls" else tokens.patches.mean(dim=1)


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
