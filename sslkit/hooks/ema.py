"""MomentumTeacherHook: the EMA update of every momentum teacher on on_update, momentum on a schedule of where."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sslkit.hooks.base import SSLHook
from sslkit.models.teacher import update_momentum
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["MomentumTeacherHook", "momentum_at"]


def momentum_at(where: float, base: float, final: float = 1.0, schedule: str = "cosine") -> float:
    """The teacher momentum at progress ``where`` in [0, 1).

    ``cosine``: ``final - (final - base) * (cos(pi * where) + 1) / 2`` (BYOL, DINO): ``base`` at
    the start, ``final`` at the end. ``linear``: ``base + (final - base) * where`` (I-JEPA).
    ``constant``: ``base`` throughout (MoCo v2).
    """
    if schedule == "constant":
        return base
    if schedule == "linear":
        return base + (final - base) * where
    if schedule == "cosine":
        return final - (final - base) * (math.cos(math.pi * where) + 1) / 2
    raise ValueError(f"unknown momentum schedule '{schedule}': use cosine, linear or constant")


@register_hook("momentum_teacher")
class MomentumTeacherHook(SSLHook):
    """After every optimizer update, move each teacher of ``task.base_model.momentum_pairs()``
    towards its student: ``t <- m t + (1 - m) s`` with ``m = momentum_at(task.clock.where, ...)``,
    a schedule on the optimizer updates of the training clock.

    The model owns its teachers (submodules, no gradients); this hook only decides when and by
    how much they move. The momentum used is the scheduled value ``teacher_momentum`` (logged).
    """

    name = "momentum_teacher"

    def __init__(self, base_momentum: float = 0.996, final_momentum: float = 1.0, schedule: str = "cosine") -> None:
        momentum_at(0.0, base_momentum, final_momentum, schedule)  # validates the schedule name
        self.base_momentum = base_momentum
        self.final_momentum = final_momentum
        self.schedule = schedule
        self.last_momentum = base_momentum

    def on_update(self, task: SSLTask) -> None:
        """EMA step of every (student, teacher) pair the model declares."""
        m = momentum_at(task.clock.where, self.base_momentum, self.final_momentum, self.schedule)
        for student, teacher in task.base_model.momentum_pairs():
            update_momentum(student, teacher, m)
        self.last_momentum = m
        task.scheduled["teacher_momentum"] = m

    def state_dict(self) -> dict[str, Any]:
        """The last momentum (the teachers themselves are in the model's state)."""
        return {"last_momentum": self.last_momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.last_momentum = state["last_momentum"]
