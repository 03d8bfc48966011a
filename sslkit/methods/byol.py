"""BYOL (Grill et al., 2020): an online network with a predictor regresses a momentum target network's projection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.models.heads import MLPHead
from sslkit.models.ssl_model import forward_views
from sslkit.models.teacher import frozen_copy
from sslkit.registry import register_loss, register_model

__all__ = ["BYOLLoss", "PredictorTeacherModel", "build_byol", "byol_loss", "check_two_views", "projection_dim"]


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


def projection_dim(trunk: nn.Module, head: nn.Module | None) -> int:
    """Output size of ``head`` (its ``out_dim``), or the trunk's when there is no head."""
    if head is not None and hasattr(head, "out_dim"):
        return int(head.out_dim)
    return int(trunk.out_dim)


class PredictorTeacherModel(nn.Module):
    """Student ``predictor(head(trunk(x)))``, teacher ``frozen_copy(head)(frozen_copy(trunk)(x))``.

    The architecture of BYOL (online network + predictor, target network) and MoCo v3 (query
    encoder + predictor, momentum encoder); the two differ only in their loss. Given two views
    ``v0, v1``, ``forward`` returns per-view student lists and the teacher outputs *paired* with
    the predictions::

        features    = [trunk(v0), trunk(v1)]                       # student trunk
        projections = [z0, z1],  z = head(trunk(v))
        predictions = [p0, p1],  p = predictor(z)
        <teacher_key> = [t(v1), t(v0)],  t = teacher_head(teacher_trunk(.))   # no grad

    so the loss compares ``predictions[i]`` with ``<teacher_key>[i]`` (the other view), whichever
    view it came from. The student views go through one batched forward (``forward_views``), as
    do the teacher's, so BatchNorm sees both views of the batch together. The teacher is a
    frozen copy (no gradients, outside the optimizer) moved by the ``momentum_teacher`` hook
    through :meth:`momentum_pairs`. ``model.trunk`` is the student trunk (kNN, feature export).
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None, predictor: nn.Module,
                 teacher_key: str = "targets") -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head if head is not None else nn.Identity()
        self.predictor = predictor
        self.teacher_trunk = frozen_copy(self.trunk)
        self.teacher_head = frozen_copy(self.head)
        self.teacher_key = teacher_key

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) pairs for the ``momentum_teacher`` hook: trunk and projector."""
        return [(self.trunk, self.teacher_trunk), (self.head, self.teacher_head)]

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Student features, projections and predictions of both views; teacher outputs, paired."""
        v0, v1 = check_two_views(views, type(self).__name__)
        feats = forward_views(self.trunk, [v0, v1])
        z = self.head(torch.cat(feats))
        p = self.predictor(z)
        with torch.no_grad():
            t = self.teacher_head(torch.cat(forward_views(self.teacher_trunk, [v1, v0])))
        return {
            "features": feats,
            "projections": list(z.chunk(2)),
            "predictions": list(p.chunk(2)),
            self.teacher_key: list(t.chunk(2)),
        }


@register_model("byol")
def build_byol(
    trunk: nn.Module,
    head: nn.Module | None = None,
    predictor_hidden_dim: int = 4096,
    predictor_num_layers: int = 2,
    predictor_last_bn: bool = False,
) -> PredictorTeacherModel:
    """BYOL: online trunk + projector (``head``) + predictor; target = frozen copy of trunk + projector.

    Paper (ImageNet, ResNet-50): projector and predictor are both ``Linear(4096) - BN - ReLU -
    Linear(256)``; the predictor maps the projection size back to itself. Outputs under
    ``"targets"``: ``targets[i]`` is the target network's projection of the other view.
    """
    dim = projection_dim(trunk, head)
    predictor = MLPHead(dim, predictor_hidden_dim, dim, num_layers=predictor_num_layers,
                        last_bn=predictor_last_bn)
    return PredictorTeacherModel(trunk, head, predictor, teacher_key="targets")


def byol_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """BYOL's regression loss of one direction (Grill et al., 2020, eq. 2), averaged over the batch.

    With ``p`` the online prediction of one view and ``z`` the target projection of the other::

        L = || p/|p| - z/|z| ||^2 = 2 - 2 * <p, z> / (|p| |z|)

    ``z`` is detached (stop-gradient on the target). 0 when ``p`` and ``z`` point the same way,
    4 when opposite.
    """
    p = F.normalize(p.float(), dim=1)
    z = F.normalize(z.detach().float(), dim=1)
    return (2 - 2 * (p * z).sum(dim=1)).mean()


@register_loss("byol")
class BYOLLoss(nn.Module):
    """BYOL's symmetrised loss: the **sum** of both directions, as in the paper
    (``L_total = L + L~``, eq. 2-3): ``byol_loss(p0, z1') + byol_loss(p1, z0')``, in [0, 8].

    Reads ``output["predictions"]`` and the teacher outputs paired with them
    (``output["targets"]``, see :class:`PredictorTeacherModel`). Logs ``cos``: the mean cosine
    similarity of prediction and target (1 when the online network predicts the target
    perfectly). Works unchanged across ranks: each sample's loss involves only that sample.
    """

    def __init__(self, target_key: str = "targets") -> None:
        super().__init__()
        self.target_key = target_key

    def forward(self, output: dict[str, Any], sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Sum over the pairs ``(predictions[i], targets[i])`` of :func:`byol_loss`."""
        preds, targets = output["predictions"], output[self.target_key]
        if len(preds) != len(targets) or not preds:
            raise ValueError(f"byol needs as many predictions as targets, got {len(preds)} and {len(targets)}")
        terms = [byol_loss(p, z) for p, z in zip(preds, targets)]
        loss = torch.stack(terms).sum()
        return {"loss": loss, "cos": 1 - loss.detach() / (2 * len(terms))}
