"""MomentumTeacherHook: the EMA update of every momentum teacher on on_update, momentum on a schedule of where."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sslkit.hooks.base import SSLHook
from sslkit.models.teacher import update_momentum
from sslkit.optim.schedules import TeacherMomentum
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["MomentumTeacherHook"]


@register_hook("momentum_teacher")
class MomentumTeacherHook(SSLHook):
    """After every optimizer update, move each teacher of ``task.base_model.momentum_pairs()``
    towards its student: ``t <- m t + (1 - m) s`` with ``m`` the :class:`~sslkit.optim.schedules.TeacherMomentum`
    at the training clock's progress (``base_momentum`` to ``final_momentum``, ``cosine``, ``linear`` or
    ``constant``).

    The model owns its teachers (submodules, no gradients); this hook only decides when and by
    how much they move. The momentum used is the scheduled value ``teacher_momentum`` (logged).
    """

    name = "momentum_teacher"

    def __init__(self, base_momentum: float = 0.996, final_momentum: float = 1.0, schedule: str = "cosine") -> None:
        self.momentum = TeacherMomentum(base_momentum, final_momentum, schedule)  # refuses an unknown name
        self.last_momentum = base_momentum

    def on_update(self, task: SSLTask) -> None:
        """EMA step of every (student, teacher) pair the model declares."""
        m = self.momentum.at(task.clock)
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
