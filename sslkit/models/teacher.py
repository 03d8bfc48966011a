"""Momentum teachers: a frozen copy of a student and the pure EMA update a hook applies to it."""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["frozen_copy", "update_momentum"]


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with ``requires_grad=False`` everywhere (so no optimizer sees it).

    The copy starts equal to the student, as in MoCo, BYOL and DINO. Kept as a submodule of the
    model, it is saved and restored with the model's state dict.
    """
    teacher = copy.deepcopy(module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


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
