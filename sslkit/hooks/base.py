"""SSLHook, the base class of every hook; Event, the moments at which hooks run; Slot, their stated order."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["Event", "SSLHook", "Slot", "in_order"]


class Event(enum.Enum):
    """Every moment at which hooks run, in the order the trainer and the stages fire them::

        on_start
        for phase in task.phases:                 # train epochs, optional eval phases
            on_phase_start
            for step:                             # standard_train_step(task), sslkit/train_steps/stages.py
                for micro-batch:                  #   optim.accumulate_steps of them in train phases
                    sample, forward
                    on_forward
                    loss, all-reduce, meters
                    on_loss_and_meter
                    backward                      #   train phases
                [manual gradient all-reduce]
                on_backward                       # train phases, once per step
                the update guard decides; optimizer step (lr, wd at task.clock.where)
                on_update                         # train phases, unless the update was dropped
                on_step                           # fired by the trainer after the step
            on_phase_end
        on_end
        # whenever a checkpoint is about to be taken (checkpoint hook, every rank):
        before_checkpoint
        # an update guard's halt (non-finite loss, out of memory) escaping the loop:
        on_halt                                   # the checkpoint hook writes the crash state here
        # any exception escaping the loop:
        on_exception                              # then re-raised

    ``on_end`` fires once, after the last phase, and not after an exception. Hooks run in the
    order of their :class:`Slot`, then in the order they were given (docs/hooks.md).
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
    BEFORE_CHECKPOINT = "before_checkpoint"
    ON_HALT = "on_halt"
    ON_EXCEPTION = "on_exception"


class Slot(enum.Enum):
    """Where a hook runs among the others, at every event: the slots run in this order.

    * ``METHOD``: method logic that changes the model's state (momentum teachers, prototype
      normalisation, frozen layers); the default, and where a user's method hook belongs;
    * ``MONITOR``: hooks that read the step (collapse monitors, the cross-rank consistency check);
    * ``LOG``: logging, so a record sees what the method and monitors did;
    * ``EVAL``: evaluations (kNN), after the phase's log line;
    * ``STOP``: pre-emption, which asks the run to stop after this step;
    * ``CHECKPOINT``: the checkpoint, last, so it holds the state every other hook left (and is
      written for a stop asked for just before).

    Within a slot, hooks keep the order they were given in (the method's, then the config's).
    """

    METHOD = "method"
    MONITOR = "monitor"
    LOG = "log"
    EVAL = "eval"
    STOP = "stop"
    CHECKPOINT = "checkpoint"


def in_order(hooks: list[SSLHook]) -> list[SSLHook]:
    """``hooks`` in the order they run: by :class:`Slot`, stable within a slot."""
    rank = {slot: i for i, slot in enumerate(Slot)}
    return sorted(hooks, key=lambda h: rank[h.slot])


class SSLHook:
    """Base class of hooks: override only the events you need; the others do nothing.

    A hook that keeps state across steps returns it from :meth:`state_dict` and takes it back
    in :meth:`load_state_dict`; the checkpoint stores it under the hook's :attr:`name`.
    :attr:`slot` places it among the other hooks (:class:`Slot`).
    """

    #: Key under which the hook's state is checkpointed; the registry name by default.
    name: str = ""
    #: Where the hook runs among the others at every event (:class:`Slot`).
    slot: Slot = Slot.METHOD

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
        """On every rank just before a checkpoint is taken (after the update guard's check). A hook
        may raise here to keep a bad state out of the checkpoints."""

    def on_halt(self, task: SSLTask) -> None:
        """When the update guard halts the run (``task.exception`` is the :class:`TrainingHalted`),
        before ``on_exception``; the checkpoint hook writes the crash state here."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (empty for stateless hooks)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
