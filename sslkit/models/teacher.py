"""Momentum teachers: a frozen copy of a student, its EMA update, the predictor-teacher wiring of BYOL and MoCo v3."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn

from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, check_two_views, forward_views

__all__ = ["NOISE_LAYERS", "PredictorTeacherModel", "frozen_copy", "projection_dim", "silence", "update_momentum"]

#: Stochastic layers of other libraries a teacher switches off, by class name (so that neither library is imported
#: here) -> the attribute that holds their probability: timm's ``DropPath``, ``PatchDropout`` and ``DropBlock2d``,
#: torchvision's ``StochasticDepth``; and timm's DINOv3 rotary embedding, whose coordinate augmentation (jitter,
#: shift, rescale) is on while ``aug_active`` (DINOv3's teachers run in eval mode: no augmentation). torch's own
#: dropouts (``nn.Dropout`` and its kin, whose ``p`` timm's attention also reads for its fused kernel) are matched
#: by type.
NOISE_LAYERS = {"DropPath": "drop_prob", "PatchDropout": "prob", "DropBlock2d": "drop_prob", "StochasticDepth": "p",
                "RotaryEmbeddingDinoV3": "aug_active"}
#: Any module type: :func:`frozen_copy` gives back the type it was given.
M = TypeVar("M", bound=nn.Module)
_TORCH_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def frozen_copy(module: M) -> M:
    """A deep copy of ``module`` with ``requires_grad=False`` everywhere (so no optimizer sees it) and no stochastic
    layer (:func:`silence`: no dropout, no drop path, whatever the student has).

    The copy starts equal to the student, as in MoCo, BYOL and DINO. Kept as a submodule of the
    model, it is saved and restored with the model's state dict.
    """
    teacher = copy.deepcopy(module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    silence(teacher)
    return teacher


def silence(module: nn.Module) -> list[str]:
    """Switch off, in place, every stochastic layer of ``module`` (dropout, drop path, patch dropout, DropBlock,
    stochastic depth: :data:`NOISE_LAYERS` and torch's dropouts) and return their names.

    A teacher is a target: two forwards of the same images must give the same output in training too. The papers'
    teachers have no drop path whatever the student has (DINO's ``main_dino.py`` builds the teacher without it,
    DINOv2 gives ``drop_path_rate`` to the student only, I-JEPA's target encoder is used under ``no_grad``). The
    teacher otherwise stays in train mode: BatchNorm keeps normalising by the batch, as MoCo's key encoder. A
    layer that draws its noise by a function call of its own (``F.dropout(x, p, self.training)``) is not seen.
    """
    silenced = []
    for name, layer in module.named_modules():
        if isinstance(layer, _TORCH_DROPOUTS):
            if layer.p:
                layer.p = 0.0
                silenced.append(name)
        elif (attribute := NOISE_LAYERS.get(type(layer).__name__)) is not None and getattr(layer, attribute, 0):
            setattr(layer, attribute, 0.0)
            silenced.append(name)
    return silenced


@torch.no_grad()
def update_momentum(student: nn.Module, teacher: nn.Module, momentum: float) -> None:
    """``teacher <- m * teacher + (1 - m) * student`` for every parameter (BYOL eq. 1, MoCo eq. 2).

    The teacher moves by exactly ``(1 - m) * (student - teacher)``. Buffers (BatchNorm running
    statistics) are not averaged: the teacher's forward in train mode keeps its own, as in
    MoCo's key encoder. Uses fused foreach kernels; no host-device sync.
    """
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")
    t_params = list(teacher.parameters())
    s_params = list(student.parameters())
    if len(t_params) != len(s_params):
        raise ValueError(f"teacher has {len(t_params)} parameters, student {len(s_params)}: not a copy")
    if momentum == 1.0 or not t_params:
        return
    torch._foreach_lerp_(t_params, [p.detach() for p in s_params], 1.0 - momentum)


def projection_dim(trunk: nn.Module, head: nn.Module | None) -> int:
    """Output size of ``head`` (its ``out_dim``), or the trunk's when there is no head."""
    if head is not None and hasattr(head, "out_dim"):
        return int(head.out_dim)
    return int(trunk.out_dim)


class PredictorTeacherModel(SSLModel):
    """Student ``predictor(head(trunk(x)))``, teacher ``frozen_copy(head)(frozen_copy(trunk)(x))``.

    The architecture of BYOL (online network + predictor, target network) and MoCo v3 (query
    encoder + predictor, momentum encoder); the two differ only in their loss. Given two views
    ``v0, v1``, ``forward`` returns per-view student lists and the teacher outputs *paired* with
    the predictions::

        features    = [trunk(v0), trunk(v1)]                       # student trunk
        projections = [z0, z1],  z = head(trunk(v))
        predictions = [p0, p1],  p = predictor(z)
        targets     = [t(v1), t(v0)],  t = teacher_head(teacher_trunk(.))   # no grad

    so the loss compares ``predictions[i]`` with ``targets[i]`` (the other view), whichever
    view it came from. The student views go through one batched forward (``forward_views``), as
    do the teacher's, so BatchNorm sees both views of the batch together. The teacher is a
    frozen copy (no gradients, outside the optimizer) moved by the ``momentum_teacher`` hook
    through :meth:`momentum_pairs`. ``model.trunk`` is the student trunk (kNN, feature export).
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None, predictor: nn.Module,
                 ) -> None:
        super().__init__(trunk, head)
        self.predictor = predictor
        self.teacher_trunk = frozen_copy(self.trunk)
        self.teacher_head = frozen_copy(self.head)

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) pairs for the ``momentum_teacher`` hook: trunk and projector."""
        return [(self.trunk, self.teacher_trunk), (self.head, self.teacher_head)]

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Student features, projections and predictions of both views; teacher outputs, paired."""
        v0, v1 = check_two_views(views, type(self).__name__)
        feats = forward_views(self.trunk, [v0, v1])
        z = self.head(torch.cat(feats))
        p = self.predictor(z)
        with torch.no_grad():
            t = self.teacher_head(torch.cat(forward_views(self.teacher_trunk, [v1, v0])))
        return ModelOutput(features=feats, projections=list(z.chunk(2)), predictions=list(p.chunk(2)),
                           targets=list(t.chunk(2)))
