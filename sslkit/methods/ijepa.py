"""I-JEPA (Assran et al., 2023): a context encoder and a narrow predictor regress an EMA encoder's patch features."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.methods.base import Method, register_method
from sslkit.methods.dinov2_parts import gather_slots, masked_slots
from sslkit.models.masking import Masks
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, encode_views
from sslkit.models.teacher import frozen_copy
from sslkit.models.tokens import TokenTrunk, key_padding_bias, pos_embed_on_grid, sincos_pos_embed
from sslkit.registry import register_loss, register_model

__all__ = ["IJEPA", "IJEPALoss", "IJEPAModel", "IJEPAPredictor", "build_ijepa", "ijepa_loss"]


class IJEPAPredictor(nn.Module):
    """I-JEPA's predictor (``src/models/vision_transformer.py``, ``VisionTransformerPredictor``): a narrow ViT.

    The context encoder's patch tokens are embedded to ``dim`` and get the fixed 2-D sine-cosine position
    embedding of their patch; for each target block, one mask token per target patch, plus that patch's
    position embedding, joins them; ``depth`` timm blocks of ``num_heads`` heads, a norm, and a linear map back
    to the encoder's width give the prediction of every target patch. Each target block is predicted in its
    own sequence (I-JEPA repeats the context once per target). Padding (the context's invalid slots, a
    target's empty slots) is left out of attention as keys. Initialised as the reference: truncated normal
    (std ``init_std``) linear weights and mask token, zero biases, the output projections of block ``i``
    divided by ``sqrt(2 i)``. Paper: dim 384, depth 12 (ViT-H/14; 6 for the smaller models of its ablations).
    """

    pos_embed: torch.Tensor

    def __init__(self, in_dim: int, grid: tuple[int, int], dim: int = 384, depth: int = 6, num_heads: int = 12,
                 mlp_ratio: float = 4.0, init_std: float = 0.02) -> None:
        super().__init__()
        if dim % num_heads or dim % 4:
            raise ValueError(f"ijepa predictor: predictor_dim={dim} must be divisible by predictor_heads={num_heads} "
                             f"and by 4")
        if depth < 1:
            raise ValueError(f"ijepa predictor: predictor_depth must be >= 1, got {depth}")
        self.grid = tuple(grid)
        self.embed = nn.Linear(in_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, self.grid)[None])
        norm = partial(nn.LayerNorm, eps=1e-6)
        from timm.models.vision_transformer import Block  # (timm: imported when one is built)

        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm)
                                     for _ in range(depth)])
        self.norm = norm(dim)
        self.proj = nn.Linear(dim, in_dim)
        nn.init.trunc_normal_(self.mask_token, std=init_std)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=init_std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        with torch.no_grad():
            for i, block in enumerate(self.blocks, start=1):
                block.attn.proj.weight.div_(math.sqrt(2.0 * i))
                block.mlp.fc2.weight.div_(math.sqrt(2.0 * i))

    def forward(self, context: torch.Tensor, context_index: torch.Tensor, context_valid: torch.Tensor,
                target_index: torch.Tensor, target_valid: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Predictions ``[B, T, M, in_dim]`` of the target patches ``target_index`` ``[B, T, M]`` (``target_valid``
        marks the real ones) from the context encoder's patch tokens ``context`` ``[B, K, in_dim]`` at the patches
        ``context_index`` ``[B, K]`` (``context_valid`` marks the real ones), on a ``grid`` of patches."""
        b, k, _ = context.shape
        t, m = target_index.shape[1:]
        pos = pos_embed_on_grid(self.pos_embed, self.grid, grid).expand(b, -1, -1)
        x = self.embed(context) + gather_slots(pos, context_index).to(context.dtype)
        d = x.shape[-1]
        x = x[:, None].expand(b, t, k, d).reshape(b * t, k, d)
        queries = gather_slots(pos, target_index.reshape(b, t * m)).reshape(b * t, m, d)
        queries = self.mask_token.to(x.dtype) + queries.to(x.dtype)
        tokens = torch.cat([x, queries], dim=1)
        valid = torch.cat([context_valid[:, None].expand(b, t, k).reshape(b * t, k), target_valid.reshape(b * t, m)],
                          dim=1)
        bias = key_padding_bias(valid, tokens.dtype)
        for block in self.blocks:
            tokens = block(tokens, attn_mask=bias)
        return self.proj(self.norm(tokens[:, k:])).reshape(b, t, m, -1)


class IJEPAModel(SSLModel):
    """I-JEPA's wiring: ``trunk`` (the context encoder, a ViT) sees each masked view's context patches
    (``Masks.keep``, padding left out of attention); its EMA copy, the target encoder, sees the whole view under
    ``no_grad``, and its patch tokens, layer-normalised without affine parameters (the reference's
    ``F.layer_norm(h, (h.size(-1),))``), at each target block's patches are the targets; the
    :class:`IJEPAPredictor` predicts them from the context.

    Outputs per masked view: ``predictions`` and ``targets`` ``[B, T, M, D]`` (``T`` target blocks of ``M`` slots,
    ``M`` the largest block the sampler can draw: :meth:`~sslkit.models.masking.MultiBlockMasking.max_target_patches`),
    ``patch_weights`` ``[B, T, M]`` (1 on a block's patches, 0 on padding), ``masks``; ``features`` /
    ``projections`` the mean of the context's patch tokens (I-JEPA has no CLS objective; sslkit's ViT carries a
    CLS token, which attends with the context and enters neither the predictor nor the loss). Views without
    masks are only encoded. ``model.trunk`` is the encoder every evaluation and the export use (evaluate it with
    ``model.trunk_kwargs.pool=avg``: the mean of the patch tokens, as the paper).
    """

    trunk: TokenTrunk

    def __init__(self, trunk: TokenTrunk, predictor: IJEPAPredictor) -> None:
        super().__init__(trunk)
        self.predictor = predictor
        self.teacher_trunk = frozen_copy(trunk)

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) pairs for the EMA hook: the context encoder and the target encoder."""
        return [(self.trunk, self.teacher_trunk)]

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor,
                masks: Sequence[Masks | None] | None = None) -> ModelOutput:
        """Encode each masked view's context, predict its target blocks, and give the target encoder's features."""
        if isinstance(views, torch.Tensor):
            views = [views]
        views = list(views)
        given = list(masks) if masks is not None else []
        given += [None] * (len(views) - len(given))
        features: list[torch.Tensor] = []
        preds, targets, weights, used, tokens = [], [], [], [], []
        for x, m in zip(views, given):
            if m is None:
                features += encode_views(self.trunk, [x])[0]
                continue
            if m.targets is None or m.keep is None:
                raise ValueError("ijepa predicts target blocks from a context: its masks must come from "
                                 "masking.name=multi_block")
            valid = m.keep_valid if m.keep_valid is not None else torch.ones_like(m.keep, dtype=torch.bool)
            ctx = self.trunk.forward_tokens(x, keep=m.keep, keep_valid=m.keep_valid)
            w = valid.to(ctx.patches.dtype)[..., None]
            features.append((ctx.patches * w).sum(1) / w.sum(1).clamp(min=1.0))
            tokens.append(ctx)
            b, t, n = m.targets.shape
            slots = m.slots or n
            index, weight = masked_slots(m.targets.reshape(b * t, n), slots)
            index, weight = index.reshape(b, t, slots), weight.reshape(b, t, slots)
            preds.append(self.predictor(ctx.patches, m.keep, valid, index, weight > 0, ctx.grid))
            with torch.no_grad():
                h = self.teacher_trunk.forward_tokens(x).patches
                h = F.layer_norm(h.float(), (h.shape[-1],))
                targets.append(gather_slots(h, index.reshape(b, t * slots)).reshape(b, t, slots, -1))
            weights.append(weight)
            used.append(m)
        return ModelOutput(features=features, projections=features, predictions=preds, targets=targets,
                           patch_weights=weights, masks=used, tokens=tokens)


@register_model("ijepa")
def build_ijepa(trunk: nn.Module, head: nn.Module | None = None, predictor_dim: int = 384, predictor_depth: int = 6,
                predictor_heads: int | None = None, predictor_mlp_ratio: float = 4.0) -> IJEPAModel:
    """I-JEPA: the ViT ``trunk`` as context encoder, its EMA copy as target encoder, and an :class:`IJEPAPredictor`
    (``model.kwargs``: predictor_dim, predictor_depth, predictor_heads, predictor_mlp_ratio; paper 384, 12 for
    ViT-H/14, the encoder's heads (null: take them), 4). I-JEPA has no projector: ``model.head.name=none``."""
    if not isinstance(trunk, TokenTrunk):
        raise ValueError("ijepa needs a ViT trunk (model.trunk=vit_tiny, vit_small, ...)")
    if head is not None and not isinstance(head, nn.Identity):
        raise ValueError("ijepa has no projector head: set model.head={name: none}")
    heads = predictor_heads or trunk.num_heads
    predictor = IJEPAPredictor(int(trunk.out_dim), trunk.base_grid,
                               predictor_dim, predictor_depth, heads, predictor_mlp_ratio)
    return IJEPAModel(trunk, predictor)


def ijepa_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    r"""I-JEPA's loss (Assran et al. 2023, eq. 1; the reference's ``F.smooth_l1_loss(z, h)``) for one view.

    ``pred`` and ``target`` ``[B, T, M, D]``, ``weight`` ``[B, T, M]`` (1 on a target block's patches):

    .. math::

        \ell_{btm} = \frac{1}{D} \sum_d \mathrm{smoothL1}_\beta(p_{btmd} - h_{btmd}), \qquad
        L = \frac{1}{B T} \sum_{b, t} \frac{\sum_m w_{btm} \ell_{btm}}{\max(1, \sum_m w_{btm})}

    with ``smoothL1(x) = x**2 / (2 beta)`` for ``|x| < beta``, else ``|x| - beta / 2``. The reference truncates
    every block of a batch to the smallest one and averages every element; with blocks of one size the two are
    equal, and this per-block mean averages exactly over ranks. Float32.
    """
    per = F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=beta).mean(dim=-1)
    w = weight.float()
    return ((per * w).sum(dim=-1) / w.sum(dim=-1).clamp(min=1.0)).mean()


@register_loss("ijepa")
class IJEPALoss(nn.Module):
    """I-JEPA's smooth L1 regression (:func:`ijepa_loss`) on each masked view, averaged over them.

    Config: ``loss: {name: ijepa, beta}`` (the reference: PyTorch's default ``beta`` 1.0; with layer-normalised
    targets most errors are below it, so the loss is nearly ``MSE / 2``). Logged: ``target_std``, the mean over
    dimensions of the std over the batch's target patches (about 1 for layer-normalised, spread targets; towards
    0 when the target encoder collapses to one vector).
    """

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"loss.beta must be > 0, got {beta}")
        self.beta = float(beta)

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """The mean over masked views of their prediction loss."""
        preds, targets, weights = output["predictions"], output["targets"], output["patch_weights"]
        if not preds:
            raise ValueError("ijepa's loss needs masked views: the model got no masks (masking.name=multi_block)")
        loss = torch.stack([ijepa_loss(p, t, w, self.beta) for p, t, w in zip(preds, targets, weights)]).mean()
        t, w = targets[0].detach().flatten(0, 2), weights[0].detach().flatten()[:, None]
        count = w.sum().clamp(min=2.0)
        mean = (t * w).sum(0) / count
        std = (((t - mean) ** 2 * w).sum(0) / (count - 1)).sqrt().mean()
        return {"loss": loss, "target_std": std}


#: The method object: what ``method.name=ijepa`` trains.
IJEPA = register_method(Method(
    name="ijepa", model="ijepa", loss="ijepa", required_hooks=("momentum_teacher",), transform="simclr",
    masking="multi_block", patch_tokens=True,
    summary=("I-JEPA (Assran et al., 2023): from a context block, a narrow predictor regresses an EMA encoder's"
             " features of four target blocks."),
))
