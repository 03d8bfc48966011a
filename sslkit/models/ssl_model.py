"""SSLModel: a trunk and a head, run on every view of a sample in as few forwards as possible."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sslkit.models.output import ModelOutput
from sslkit.registry import register_model

__all__ = ["SSLModel", "build_ssl_model", "check_two_views", "forward_views"]


def forward_views(module: nn.Module, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``module`` on each view, batching consecutive views of equal shape into one forward.

    Multi-crop inputs (2 large + N small crops) thus take two forwards, not 2 + N. BatchNorm sees
    the views of one resolution together, as in SimCLR's and SwAV's reference code.
    """
    outputs: list[torch.Tensor] = []
    start = 0
    while start < len(views):
        end = start + 1
        while end < len(views) and views[end].shape[1:] == views[start].shape[1:]:
            end += 1
        group = views[start:end]
        out = module(torch.cat(list(group)) if len(group) > 1 else group[0])
        outputs.extend(out.chunk(len(group)) if len(group) > 1 else [out])
        start = end
    return outputs


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
    """Trunk + head. ``forward(views)`` returns ``{"features": [...], "projections": [...]}``,
    one tensor per view, in the order of the views.

    Methods with a momentum teacher or a predictor subclass this (sslkit/methods/) and add
    their own submodules, so a checkpoint of the model holds them.
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head if head is not None else nn.Identity()

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Trunk features and head projections for each view."""
        if isinstance(views, torch.Tensor):
            views = [views]
        feats = forward_views(self.trunk, views)
        sizes = [f.shape[0] for f in feats]
        proj = self.head(torch.cat(feats)) if len(feats) > 1 else self.head(feats[0])
        return ModelOutput(features=feats, projections=list(proj.split(sizes)))


@register_model("ssl_model")
def build_ssl_model(trunk: nn.Module, head: nn.Module | None = None) -> SSLModel:
    """Trunk + projector, no teacher (SimCLR, Barlow Twins, VICReg)."""
    return SSLModel(trunk, head)
