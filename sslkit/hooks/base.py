"""SSLHook, the base class of every hook, and Event, the ten moments at which hooks run."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["Event", "SSLHook"]


class Event(enum.Enum):
    """The events of a run, in the order the trainer fires them (VISSL's ten)::

        on_start
        for phase in task.phases:                 # train epochs, optional eval phases
            on_phase_start
            for sample in loader:                 # standard_train_step(task):
                forward
                on_forward
                loss, all-reduce, meters
                on_loss_and_meter
                if train phase:
                    zero_grad, backward (scaled for fp16), [manual grad all-reduce]
                    on_backward
                    optimizer step (lr, wd from the schedule at task.where)
                    on_update
                on_step                           # fired by the trainer after the step
            on_phase_end
        on_end
        # any exception escaping the loop:
        on_exception                              # then re-raised

    ``on_backward`` and ``on_update`` fire only in train phases. ``on_end`` fires once, after
    the last phase, and not after an exception.
    """

    ON_START = "on_start"
    ON_PHASE_START = "on_phase_start"
    ON_FORWARD = "on_forward"
    ON_LOSS_AND_METER = "on_loss_and_meter"
    ON_BACKWARD = "on_backward"
    ON_UPDATE = "on_update"
    ON_STEP = "on_step"
    ON_PHASE_END = "on_phase_end"
    ON_END = "on_end"
    ON_EXCEPTION = "on_exception"


class SSLHook:
    """Base class of hooks: override only the events you need; the others do nothing.

    A hook that keeps state across steps returns it from :meth:`state_dict` and takes it back
    in :meth:`load_state_dict`; the checkpoint stores it under the hook's :attr:`name`.
    ``priority`` orders hooks (lower runs first; ties keep the config order).
    """

    #: Key under which the hook's state is checkpointed; the registry name by default.
    name: str = ""
    #: Lower runs first. Method hooks 0, logging 50, checkpointing 90, so a checkpoint taken on
    #: ``on_step`` sees the state that every other hook has already updated.
    priority: int = 0

    def on_start(self, task: SSLTask) -> None:
        """Once, before the first phase (after a resume, the restored state is in place)."""

    def on_phase_start(self, task: SSLTask) -> None:
        """At the start of each phase (train epoch or eval pass)."""

    def on_forward(self, task: SSLTask) -> None:
        """After the model's forward; ``task.last_batch.model_output`` is set."""

    def on_loss_and_meter(self, task: SSLTask) -> None:
        """After the loss is computed, all-reduced and metered; ``task.last_batch.loss`` is set."""

    def on_backward(self, task: SSLTask) -> None:
        """Train phases: after backward (and any manual gradient reduction), before the step."""

    def on_update(self, task: SSLTask) -> None:
        """Train phases: after the optimizer step (EMA teachers update here)."""

    def on_step(self, task: SSLTask) -> None:
        """After every step, train or eval."""

    def on_phase_end(self, task: SSLTask) -> None:
        """At the end of each phase."""

    def on_end(self, task: SSLTask) -> None:
        """Once, after the last phase of a run that completed."""

    def on_exception(self, task: SSLTask) -> None:
        """When any exception escapes the loop; ``task.exception`` holds it. Then re-raised."""

    def before_checkpoint(self, task: SSLTask) -> None:
        """Not an event of the loop: called on every rank just before a checkpoint is taken.
        A hook may raise here to keep a bad state out of the checkpoints (the non-finite loss
        guard does)."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (empty for stateless hooks)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
