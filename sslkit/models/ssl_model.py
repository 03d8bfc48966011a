"""SSLModel: a trunk and a head, run on every view of a sample in as few forwards as possible."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sslkit.models.output import ModelOutput
from sslkit.models.tokens import TokenTrunk
from sslkit.registry import register_model

__all__ = ["SSLModel", "build_ssl_model", "check_two_views", "encode_views", "equal_shape_runs", "forward_views"]


def equal_shape_runs(views: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``(count, batch)`` for each run of consecutive views of equal shape, the run's views concatenated."""
    runs: list[tuple[int, torch.Tensor]] = []
    start = 0
    while start < len(views):
        end = start + 1
        while end < len(views) and views[end].shape[1:] == views[start].shape[1:]:
            end += 1
        group = views[start:end]
        runs.append((len(group), torch.cat(list(group)) if len(group) > 1 else group[0]))
        start = end
    return runs


def forward_views(module: nn.Module, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``module`` on each view, batching consecutive views of equal shape into one forward.

    Multi-crop inputs (2 large + N small crops) thus take two forwards, not 2 + N. BatchNorm sees
    the views of one resolution together, as in SimCLR's and SwAV's reference code.
    """
    outputs: list[torch.Tensor] = []
    for n, batch in equal_shape_runs(views):
        out = module(batch)
        outputs.extend(out.chunk(n) if n > 1 else [out])
    return outputs


def encode_views(trunk: nn.Module, views: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any] | None]:
    """The trunk's features of each view and, for a ViT (a :class:`~sslkit.models.tokens.TokenTrunk`), its
    tokens too.

    Views of equal shape go through one forward, as :func:`forward_views`. A ViT's features are its pooled
    tokens (:meth:`~sslkit.models.vit_trunk.ViTTrunk.pool_tokens`), the very tensors of the tokens returned
    (:class:`~sslkit.models.tokens.Tokens`, one per view), so the model output carries both for one forward.
    """
    if not isinstance(trunk, TokenTrunk):
        return forward_views(trunk, views), None
    features: list[torch.Tensor] = []
    tokens: list[Any] = []
    for n, batch in equal_shape_runs(views):
        t = trunk.forward_tokens(batch)
        pooled = trunk.pool_tokens(t)
        for c, r, p, f in zip(t.cls.chunk(n), t.registers.chunk(n), t.patches.chunk(n), pooled.chunk(n)):
            tokens.append(type(t)(cls=c, registers=r, patches=p, grid=t.grid))
            features.append(f)
    return features, tokens


def check_two_views(views: Sequence[torch.Tensor] | torch.Tensor, method: str) -> list[torch.Tensor]:
    """The first two views as a list; a clear error when fewer than two are given."""
    if isinstance(views, torch.Tensor):
        views = [views]
    if len(views) < 2:
        raise ValueError(f"{method} needs two views per sample (data.transform.num_views=2), got {len(views)}")
    if views[0].shape != views[1].shape:
        raise ValueError(f"{method} needs two views of the same size, got {tuple(views[0].shape)} "
                         f"and {tuple(views[1].shape)}")
    return [views[0], views[1]]


class SSLModel(nn.Module):
    """Trunk + head, and what every SSL model of sslkit meets: ``trunk`` (the network every evaluation reads and
    the export writes), ``head``, ``forward(views)`` (masked methods: ``forward(views, masks)``) giving a
    :class:`ModelOutput` (``features`` and ``projections``, one tensor per view, in the order of the views), and
    :meth:`momentum_pairs`. This one is the plain two-view model.

    Every method's wiring subclasses it (sslkit/methods/) and adds its own submodules (teachers, predictors,
    decoders), so a checkpoint of the model holds them.
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head if head is not None else nn.Identity()

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """The (student, teacher) pairs the ``momentum_teacher`` hook moves: none without a momentum teacher."""
        return []

    def trunk_copies(self) -> list[nn.Module]:
        """The frozen networks that are copies of :attr:`trunk` (its momentum teachers; DINOv3's Gram teacher
        too): what starts equal to the trunk when released weights are loaded into it."""
        return [teacher for student, teacher in self.momentum_pairs() if student is self.trunk]

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Trunk features and head projections for each view."""
        if isinstance(views, torch.Tensor):
            views = [views]
        feats, tokens = encode_views(self.trunk, views)
        sizes = [f.shape[0] for f in feats]
        proj = self.head(torch.cat(feats)) if len(feats) > 1 else self.head(feats[0])
        return ModelOutput(features=feats, projections=list(proj.split(sizes)), tokens=tokens)


@register_model("ssl_model")
def build_ssl_model(trunk: nn.Module, head: nn.Module | None = None) -> SSLModel:
    """Trunk + projector, no teacher (SimCLR, Barlow Twins, VICReg)."""
    return SSLModel(trunk, head)
