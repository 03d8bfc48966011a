"""The events of a run, the slots that order hooks, and what the task needs of a hook (no sslkit imports)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

__all__ = ["Event", "Hook", "Slot", "in_order"]


class Event(enum.Enum):
    """Every moment at which hooks run, in the order the trainer and the stages fire them::

        on_start
        for phase in task.phases:                 # train epochs, optional eval phases
            on_phase_start
            for step:                             # standard_train_step(task), sslkit/train_steps/stages.py
                for micro-batch:                  #   optim.micro_batches of them in train phases
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


class Hook(Protocol):
    """What the task needs of a hook (:class:`sslkit.hooks.base.SSLHook` has it all): a name under which its
    state is checkpointed, a slot, its state, and one method per :class:`Event` taking the task."""

    name: str
    slot: Slot

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


H = TypeVar("H", bound=Hook)


def in_order(hooks: Iterable[H]) -> list[H]:
    """``hooks`` in the order they run: by :class:`Slot`, stable within a slot."""
    rank = {slot: i for i, slot in enumerate(Slot)}
    return sorted(hooks, key=lambda h: rank[h.slot])

