"""MAE (He et al., 2022): a ViT encoder on the visible patches, a light decoder, the pixels of the masked patches."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from sslkit.clock import StepContext
from sslkit.methods.base import Method, register_method
from sslkit.models.masking import Masks
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel
from sslkit.models.tokens import Tokens, TokenTrunk, pos_embed_on_grid, sincos_pos_embed
from sslkit.registry import register_loss, register_model

__all__ = ["MAE", "MAEDecoder", "MAELoss", "MAEModel", "build_mae", "mae_loss", "patchify"]


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, N, p * p * C]``: each patch's pixels, patches in raster order, a patch's values in
    (row, column, channel) order (MAE's ``patchify``: ``nchpwq -> nhwpqc``)."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def mae_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, norm_pix: bool = True) -> torch.Tensor:
    """MAE's reconstruction loss (He et al. 2022, section 3, "Reconstruction target"; ``models_mae.forward_loss``).

    ``pred`` and ``target`` are ``[B, N, P]`` (predicted and true pixels of each patch), ``mask`` ``[B, N]``
    weights, 1 on the patches the encoder did not see. With ``norm_pix`` each target patch is normalised
    by its own mean and (unbiased) variance, ``(t - mean) / sqrt(var + 1e-6)``. Then::

        l_bn = mean_p (pred[b, n, p] - target[b, n, p])**2          # per patch
        L    = mean_b ( sum_n mask[b, n] l_bn / sum_n mask[b, n] )   # masked patches only

    MAE writes ``sum(l * mask) / sum(mask)`` over the whole batch; with the same number of masked patches
    in every image (random masking) the two are equal, and this per-image form also averages exactly
    over ranks (a dense, weighted sum: no boolean indexing). An image without masked patches adds 0.
    Computed in float32.
    """
    pred, target, mask = pred.float(), target.float(), mask.float()
    if norm_pix:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    per_patch = (pred - target).pow(2).mean(dim=-1)
    return ((per_patch * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()


class MAEDecoder(nn.Module):
    """MAE's decoder: the encoder's tokens embedded to ``dim``, a mask token at every hidden patch, fixed sine-cosine
    position embeddings, ``depth`` timm ViT blocks of ``num_heads`` heads, a norm and a linear map to each patch's
    ``patch * patch * channels`` pixels (paper: dim 512, 8 blocks, 16 heads; "lightweight": < 10% of the
    encoder's compute per token). The encoder's prefix tokens (CLS, registers) go through it too, as MAE's
    CLS does, and are dropped from the output. Linear layers are Xavier-initialised, the mask token
    N(0, 0.02), as MAE's ``initialize_weights``."""

    pos_embed: torch.Tensor

    def __init__(self, in_dim: int, grid: tuple[int, int], patch_size: int, channels: int, dim: int = 512,
                 depth: int = 8, num_heads: int = 16, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if dim % num_heads or dim % 4:
            raise ValueError(f"mae decoder: decoder_dim={dim} must be divisible by decoder_heads={num_heads} and by 4")
        self.grid = tuple(grid)
        self.embed = nn.Linear(in_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, self.grid)[None])
        norm = partial(nn.LayerNorm, eps=1e-6)
        from timm.models.vision_transformer import Block  # (timm: imported when one is built)

        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm)
                                      for _ in range(depth)])
        self.norm = norm(dim)
        self.pred = nn.Linear(dim, patch_size * patch_size * channels)
        nn.init.normal_(self.mask_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, tokens: Tokens, restore: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, N, p * p * C]`` of every patch from the encoder's ``tokens`` of the kept patches and
        ``restore`` ``[B, N]`` (:meth:`~sslkit.models.masking.Masks.restore_order`)."""
        prefix = torch.cat([tokens.cls[:, None], tokens.registers], dim=1)
        x = self.embed(torch.cat([prefix, tokens.patches], dim=1))
        prefix, kept = x[:, :prefix.shape[1]], x[:, prefix.shape[1]:]
        b, k, d = kept.shape
        n = restore.shape[1]
        full = torch.cat([kept, self.mask_token.to(kept.dtype).expand(b, n - k, d)], dim=1)
        pos = pos_embed_on_grid(self.pos_embed, self.grid, tokens.grid)  # type: ignore[arg-type]
        full = full.gather(1, restore[..., None].expand(-1, -1, d)) + pos
        x = self.norm(self.blocks(torch.cat([prefix, full], dim=1)))
        return self.pred(x[:, prefix.shape[1]:])


class MAEModel(SSLModel):
    """MAE wiring: ``trunk`` (a ViT, sslkit's timm wrapper) encodes the patches ``masks[v].keep`` of each masked
    view; the :class:`MAEDecoder` predicts the pixels of every patch. Views without masks are only encoded.

    ``forward(views, masks)`` returns ``predictions`` (decoder output ``[B, N, P]``), ``targets`` (the view's
    pixels per patch, as normalised by the augmentation: MAE's ``imgs``) and ``masks``, one of each per masked
    view; ``features`` / ``projections`` the pooled encoder tokens of the visible patches, ``tokens`` the
    encoder's tokens. ``model.trunk`` is the encoder every evaluation and the export use.
    """

    trunk: TokenTrunk

    def __init__(self, trunk: TokenTrunk, decoder: MAEDecoder) -> None:
        super().__init__(trunk)
        self.decoder = decoder

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor,
                masks: Sequence[Masks | None] | None = None) -> ModelOutput:
        """Encode, decode and return the reconstruction of every masked view."""
        if isinstance(views, torch.Tensor):
            views = [views]
        masks = list(masks) if masks is not None else [None] * len(views)
        features, tokens, preds, targets, given = [], [], [], [], []
        patch = int(self.trunk.patch_size)
        for x, m in zip(views, masks):
            if m is not None and (m.keep is None or m.keep_valid is not None):
                raise ValueError("mae drops the masked patches: its masks must keep exactly the visible ones "
                                 "(masking.name=random)")
            t = self.trunk.forward_tokens(x, keep=None if m is None else m.keep)
            features.append(self.trunk.pool_tokens(t))
            tokens.append(t)
            if m is not None:
                preds.append(self.decoder(t, m.restore_order()))
                targets.append(patchify(x, patch))
                given.append(m)
        return ModelOutput(features=features, projections=features, predictions=preds, targets=targets,
                           tokens=tokens, masks=given)


@register_model("mae")
def build_mae(trunk: nn.Module, head: nn.Module | None = None, decoder_dim: int = 512, decoder_depth: int = 8,
              decoder_heads: int = 16, decoder_mlp_ratio: float = 4.0) -> MAEModel:
    """MAE: the ViT ``trunk`` as encoder and a :class:`MAEDecoder` (``model.kwargs``: decoder_dim, decoder_depth,
    decoder_heads, decoder_mlp_ratio; paper 512, 8, 16, 4). MAE has no projector: ``model.head.name=none``."""
    if not isinstance(trunk, TokenTrunk):
        raise ValueError("mae needs a ViT trunk (model.trunk=vit_tiny, vit_small, ...)")
    if head is not None and not isinstance(head, nn.Identity):
        raise ValueError("mae has no projector head: set model.head={name: none}")
    decoder = MAEDecoder(int(trunk.out_dim), trunk.base_grid, trunk.patch_size, trunk.in_channels, decoder_dim,
                         decoder_depth, decoder_heads, decoder_mlp_ratio)
    return MAEModel(trunk, decoder)


@register_loss("mae")
class MAELoss(nn.Module):
    """MAE's pixel loss (:func:`mae_loss`) on each masked view, averaged over them.

    Config: ``loss: {name: mae, norm_pix_loss}`` (paper: ``norm_pix_loss`` true, its best setting). Reads
    ``output["predictions"]``, ``output["targets"]`` and ``output["masks"]`` of the ``mae`` model.
    """

    def __init__(self, norm_pix_loss: bool = True) -> None:
        super().__init__()
        self.norm_pix_loss = bool(norm_pix_loss)

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> torch.Tensor:
        """The mean over masked views of their reconstruction loss."""
        preds, targets, masks = output["predictions"], output["targets"], output["masks"]
        if not preds:
            raise ValueError("mae's loss needs masked views: the model got no masks (masking.name=random)")
        losses = [mae_loss(p, t, m.mask, self.norm_pix_loss) for p, t, m in zip(preds, targets, masks)]
        return torch.stack(losses).mean()


#: The method object: what ``method.name=mae`` trains.
MAE = register_method(Method(
    name="mae", model="mae", loss="mae", required_hooks=(), transform="simclr", masking="random",
    patch_tokens=True,
    summary=("MAE (He et al., 2022): a ViT encodes a random 25% of the patches, a light decoder predicts the"
             " normalised pixels of the others."),
))
