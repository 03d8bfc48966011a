"""SimSiam (Chen & He, 2021): a Siamese encoder + predictor with stop-gradient and no negatives, no teacher."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.methods.base import Method, register_method
from sslkit.models.heads import MLPHead
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, check_two_views, forward_views
from sslkit.models.teacher import projection_dim
from sslkit.registry import register_loss, register_model

__all__ = ["SIMSIAM", "SimSiamLoss", "SimSiamModel", "build_simsiam", "negative_cosine"]


class SimSiamModel(SSLModel):
    """Encoder ``f = head(trunk(.))`` and predictor ``h``, shared by both views (no momentum encoder).

    ``forward([v0, v1])`` returns ``features`` and ``projections`` ``[z0, z1]`` per view,
    ``predictions`` ``[p0, p1]`` (``p = h(z)``) and ``targets`` ``[z1, z0]`` detached: the
    stop-gradient branch paired with each prediction (``targets[i]`` is the other view's
    projection). Both views go through one batched forward.
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None, predictor: nn.Module) -> None:
        super().__init__(trunk, head)
        self.predictor = predictor

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Features, projections, predictions of both views, and the stop-gradient targets."""
        v0, v1 = check_two_views(views, "simsiam")
        feats = forward_views(self.trunk, [v0, v1])
        z = self.head(torch.cat(feats))
        p = self.predictor(z)
        z0, z1 = z.chunk(2)
        return ModelOutput(features=feats, projections=[z0, z1], predictions=list(p.chunk(2)),
                           targets=[z1.detach(), z0.detach()])


@register_model("simsiam")
def build_simsiam(
    trunk: nn.Module,
    head: nn.Module | None = None,
    predictor_hidden_dim: int = 512,
    predictor_num_layers: int = 2,
) -> SimSiamModel:
    """SimSiam: trunk + projector (``head``) + bottleneck predictor.

    Paper (ImageNet, ResNet-50): projector 3 layers, 2048-d, BN on every layer including the
    output (``model.head: {num_layers: 3, hidden_dim: 2048, out_dim: 2048, last_bn: true}``);
    predictor ``Linear(2048, 512) - BN - ReLU - Linear(512, 2048)`` with no BN or ReLU on its
    output (a bottleneck: ``predictor_hidden_dim`` = out / 4).
    """
    dim = projection_dim(trunk, head)
    predictor = MLPHead(dim, predictor_hidden_dim, dim, num_layers=predictor_num_layers, last_bn=False)
    return SimSiamModel(trunk, head, predictor)


def negative_cosine(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """SimSiam's ``D(p, stopgrad(z)) = - <p/|p|, z/|z|>`` (Chen & He, 2021, eq. 1 and 3), batch mean.

    ``z`` is detached: the stop-gradient that prevents collapse. In [-1, 1]; -1 when aligned.
    """
    p = F.normalize(p.float(), dim=1)
    z = F.normalize(z.detach().float(), dim=1)
    return -(p * z).sum(dim=1).mean()


@register_loss("simsiam")
class SimSiamLoss(nn.Module):
    """``L = D(p1, stopgrad(z2)) / 2 + D(p2, stopgrad(z1)) / 2`` (eq. 3): the mean over the
    pairs ``(predictions[i], targets[i])``. Minimum -1.

    Returns the scalar loss; the ``collapse_monitor`` hook tracks the spread of the
    projections, the failure mode the paper studies (section 4.1).
    """

    def forward(self, output: dict[str, Any], sample: dict[str, Any], ctx: StepContext | None = None) -> torch.Tensor:
        """Mean over pairs of :func:`negative_cosine`."""
        preds, targets = output["predictions"], output["targets"]
        if len(preds) != len(targets) or not preds:
            raise ValueError(f"simsiam needs as many predictions as targets, got {len(preds)} and {len(targets)}")
        return torch.stack([negative_cosine(p, z) for p, z in zip(preds, targets)]).mean()


#: The method object: what ``method.name=simsiam`` trains.
SIMSIAM = register_method(Method(
    name="simsiam", model="simsiam", loss="simsiam", required_hooks=(), transform="simclr",
    summary="SimSiam (Chen & He, 2021): a predictor and a stop-gradient, no negatives and no teacher.",
))
