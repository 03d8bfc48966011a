"""The training loop: phases, steps and events, with the exception path in plain sight."""

from __future__ import annotations

from collections.abc import Callable

from sslkit.hooks.base import Event
from sslkit.task import SSLTask

__all__ = ["train"]


def train(task: SSLTask, step: Callable[[SSLTask], None]) -> None:
    """Run every remaining phase of ``task`` with the train step ``step``.

    Each phase runs until its loader is exhausted (``StopIteration`` from the step) or, in
    train phases, until ``task.max_iterations`` optimizer steps are done; a phase cut that way
    stays the current one (its position is where a lengthened run goes on). See
    :class:`sslkit.hooks.base.Event` for the order of events. Any exception fires
    ``on_exception`` (with ``task.exception`` set) and is re-raised.
    """
    try:
        task.run_hooks(Event.ON_START)
        while not task.done_training:
            if task.out_of_steps:
                # max_iterations reached: the remaining train phases are skipped, and the position stays in
                # the phase that was cut (a run lengthened later goes on from that step); eval phases still run
                later = [i for i in range(task.phase_idx + 1, len(task.phases)) if not task.phases[i].train]
                if not later:
                    break
                task.advance_phase(to=later[0])
                continue
            task.start_phase()
            task.run_hooks(Event.ON_PHASE_START)
            exhausted = False
            while not task.out_of_steps:
                try:
                    step(task)
                except StopIteration:
                    exhausted = True
                    break
                task.steps_in_phase += 1
                task.run_hooks(Event.ON_STEP)
            task.end_phase(exhausted)
            task.run_hooks(Event.ON_PHASE_END)
            if task.phase_done:
                task.advance_phase()
        task.run_hooks(Event.ON_END)
    except BaseException as exc:
        task.exception = exc
        task.run_hooks(Event.ON_EXCEPTION)
        raise
