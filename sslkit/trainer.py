"""The training loop: phases, steps and events, with the exception path in plain sight."""

from __future__ import annotations

from collections.abc import Callable

from sslkit.events import Event
from sslkit.guard import TrainingHalted
from sslkit.reliability import Preempted
from sslkit.task import SSLTask

__all__ = ["train"]


def train(task: SSLTask, step: Callable[[SSLTask], None]) -> None:
    """Run every remaining phase of ``task`` with the train step ``step``.

    Each phase runs until its loader is exhausted (``StopIteration`` from the step) or, in
    train phases, until ``task.clock.max_steps`` optimizer steps are done; a phase cut that way
    stays the current one (its position is where a lengthened run goes on). See
    :class:`sslkit.hooks.base.Event` for the order of events.

    The trainer acts on what others decided: after a train step at the update guard's interval,
    and at the end of each train phase, it has the guard check the losses (policy ``halt``); a
    stop asked for by the pre-emption hook (and checkpointed by the checkpoint hook) ends the run
    with :class:`Preempted` after ``on_step`` or ``on_phase_end``. A :class:`TrainingHalted`
    fires ``on_halt`` (the crash checkpoint); any exception then fires ``on_exception`` (with
    ``task.exception`` set) and is re-raised.
    """
    try:
        task.run_hooks(Event.ON_START)
        while not task.done_training:
            if task.out_of_steps:
                # clock.max_steps reached: the remaining train phases are skipped, and the position stays in
                # the phase that was cut (a run lengthened later goes on from that step); eval phases still run
                later = [i for i in range(task.phase_idx + 1, len(task.phases)) if not task.phases[i].train]
                if not later:
                    break
                task.advance_phase(to=later[0])
                continue
            task.start_phase()
            task.run_hooks(Event.ON_PHASE_START)
            exhausted = False
            per_phase = task.steps_per_phase
            while not task.out_of_steps:
                if task.train and per_phase is not None and task.clock.step_in_epoch >= per_phase:
                    # the epoch's whole steps are done: what is left (fewer batches than an accumulated step
                    # takes) is not read, so no half-step's state (DINO's centre sums) crosses into the next
                    exhausted = True
                    break
                try:
                    step(task)
                except StopIteration:
                    exhausted = True
                    break
                task.clock.step_in_epoch += 1
                if task.train and task.guard.due(task):
                    task.guard.check(task)
                task.run_hooks(Event.ON_STEP)
                _stop_if_requested(task)
            task.end_phase(exhausted)
            if task.train:
                task.guard.check(task)
            task.run_hooks(Event.ON_PHASE_END)
            _stop_if_requested(task)
            if task.phase_done:
                task.advance_phase()
        task.run_hooks(Event.ON_END)
    except BaseException as exc:
        task.exception = exc
        if isinstance(exc, TrainingHalted):
            task.run_hooks(Event.ON_HALT)
        task.run_hooks(Event.ON_EXCEPTION)
        raise


def _stop_if_requested(task: SSLTask) -> None:
    if task.stop_requested is not None:
        raise Preempted(task.stop_requested, task.clock.step, task.stop_checkpoint)
