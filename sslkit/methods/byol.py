"""BYOL (Grill et al., 2020): an online network with a predictor regresses a momentum target network's projection."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.methods.base import Method, register_method
from sslkit.models.heads import MLPHead
from sslkit.models.teacher import PredictorTeacherModel, projection_dim
from sslkit.registry import register_loss, register_model

__all__ = ["BYOL", "BYOLLoss", "build_byol", "byol_loss"]


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
    return PredictorTeacherModel(trunk, head, predictor)


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


    def forward(self, output: dict[str, Any], sample: dict[str, Any],
                ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """Sum over the pairs ``(predictions[i], targets[i])`` of :func:`byol_loss`."""
        preds, targets = output["predictions"], output["targets"]
        if len(preds) != len(targets) or not preds:
            raise ValueError(f"byol needs as many predictions as targets, got {len(preds)} and {len(targets)}")
        terms = [byol_loss(p, z) for p, z in zip(preds, targets)]
        loss = torch.stack(terms).sum()
        return {"loss": loss, "cos": 1 - loss.detach() / (2 * len(terms))}


#: The method object: what ``method.name=byol`` trains.
BYOL = register_method(Method(
    name="byol", model="byol", loss="byol", required_hooks=("momentum_teacher",), transform="simclr",
    summary="BYOL (Grill et al., 2020): an online network with a predictor regresses a momentum target network.",
))
