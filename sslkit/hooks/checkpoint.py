"""CheckpointHook: when to save the task state (periodically, at epoch ends, at a stop, at the end of the run); how
is the Checkpointer's (sslkit/checkpoint.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sslkit.checkpoint import Checkpointer
from sslkit.distributed import is_primary
from sslkit.guard import TrainingHalted
from sslkit.hooks.base import Event, Slot, SSLHook
from sslkit.parallel import is_sharded
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["CheckpointHook"]


@register_hook("checkpoint")
class CheckpointHook(SSLHook):
    """Save the task's state (:meth:`~sslkit.checkpoint.Checkpointer.state`) every ``every_n_steps`` optimizer steps
    (0 = never), after every ``every_n_epochs`` train epochs (0 = never) and the last one, and once more at the end of
    the run, and when the run is asked to stop (``task.stop_requested``, a pre-emption). It runs in
    the last slot, so every other hook's state of this step is included. Only rank 0 writes; every
    rank takes part (the RNG states of all ranks are saved). When the update guard halts the run,
    ``on_halt`` writes the state at the stop as ``crash_<step>.pt`` (for inspection, never resumed
    from) and names the checkpoint a rerun resumes from.

    The end of the last epoch and the end of the run are the same step: the end-of-run save
    rewrites that file only if a hook's state changed in between (the final kNN results), and
    logs it as an update naming those hooks; otherwise nothing is written or logged twice.

    ``sharded``: write sharded checkpoint folders (:mod:`sslkit.checkpointing.sharded`), every rank its part, instead
    of one file gathered by rank 0; ``async_save`` then lets the periodic saves write in the background (a stop
    and the end of the run wait for theirs). A folder becomes the latest checkpoint (``latest.txt``) only once
    complete.
    """

    slot = Slot.CHECKPOINT

    def __init__(self, output_dir: str, every_n_epochs: int = 1, every_n_steps: int = 0, keep_last: int = 3,
                 sharded: bool = False, async_save: bool = False) -> None:
        self.checkpointer = Checkpointer(output_dir, keep_last, sharded=sharded, async_save=async_save)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self._saved: tuple[int, dict[str, Any]] | None = None  # step and hook states of the last save
        self._saved_path: str | None = None

    def save(self, task: SSLTask, why: str, wait: bool = True) -> str | None:
        """Write a checkpoint now; returns its path on rank 0 (None elsewhere).

        Every rank calls it at the same point: the update guard checks that no step so far had a
        non-finite loss (a state past one never becomes a checkpoint), ``before_checkpoint`` fires,
        and the checkpointer writes the state (:meth:`sslkit.checkpoint.Checkpointer.save`: every rank's RNG,
        a barrier after; sharded, ``wait=False`` with ``async_save`` returns once the state is copied).
        """
        task.guard.check(task)
        task.run_hooks(Event.BEFORE_CHECKPOINT)
        path, hooks = self.checkpointer.save(task, why, wait)
        self._saved = (task.clock.step, hooks)
        self._saved_path = path
        return path

    def save_once(self, task: SSLTask, why: str) -> str | None:
        """:meth:`save`, unless the checkpoint of this step with these hook states is written already
        (e.g. at the end of an epoch): then its path (rank 0) is returned and nothing is written."""
        if self._saved is not None and self._saved[0] == task.clock.step and not self._changed(task):
            return self._saved_path
        return self.save(task, why)

    def _changed(self, task: SSLTask) -> list[str]:
        """Names of the hooks whose state differs from that in the last save."""
        assert self._saved is not None
        before, now = self._saved[1], self.checkpointer.hook_states(task)
        return [name for name, state in now.items() if not _same(before.get(name), state)]

    def on_start(self, task: SSLTask) -> None:
        """A resumed run stands where its checkpoint was written: nothing to save there again unless a hook's
        state changes (a finished run started again writes nothing)."""
        if task.clock.step > 0:
            self._saved = (task.clock.step, self.checkpointer.hook_states(task))
            self._saved_path = self.checkpointer.latest() if is_primary() else None

    def on_step(self, task: SSLTask) -> None:
        """Save at the step interval (train phases), and when the run is asked to stop."""
        if task.train and self.every_n_steps > 0 and task.clock.step % self.every_n_steps == 0:
            self.save(task, f"step {task.clock.step}", wait=False)
        self._save_for_stop(task)

    def _save_for_stop(self, task: SSLTask) -> None:
        if task.stop_requested is not None:
            self.checkpointer.finish_pending()
            task.stop_checkpoint = self.save_once(task, f"pre-emption by {task.stop_requested}")

    def on_halt(self, task: SSLTask) -> None:
        """The update guard halted the run: write the state at the stop as ``crash_<step>.pt`` (rank 0, no
        collective: this is an error path, so only rank 0's RNG state is in it) and name, in the error, that
        file and the checkpoint a rerun resumes from (``latest.txt`` keeps naming the last good one)."""
        exc = task.exception
        if not isinstance(exc, TrainingHalted):
            return
        if is_primary() or is_sharded(task.model):  # under FSDP2 the model is gathered: every rank takes part
            state = self.checkpointer.state(task, gather_rng=False)
        if is_primary():
            exc.crash_path = self.checkpointer.write_crash(state, task.clock.step, exc.message)
        exc.resume_from = self.checkpointer.latest()
        exc.checked_checkpoints = True

    def on_phase_end(self, task: SSLTask) -> None:
        """Save after every ``every_n_epochs`` train epochs and after the last train phase."""
        if not task.train:
            return
        last_train = not any(p.train for p in task.phases[task.phase_idx + 1 :]) or task.out_of_steps
        epoch_due = self.every_n_epochs > 0 and (task.epoch + 1) % self.every_n_epochs == 0
        if epoch_due or last_train:
            self.save(task, f"end of epoch {task.epoch}", wait=last_train)
        self._save_for_stop(task)

    def on_end(self, task: SSLTask) -> None:
        """Save the final state, with the results of the hooks that ran at the end (kNN), unless the
        checkpoint of this step already holds it."""
        self.checkpointer.finish_pending()
        if self._saved is not None and self._saved[0] == task.clock.step:
            changed = self._changed(task)
            if not changed:
                return
            self.save(task, f"updated at the end of the run with the state of {', '.join(changed)}")
            return
        self.save(task, "end of run")


def _same(a: Any, b: Any) -> bool:
    """Exact equality of two hook states (nested dicts, lists, tensors, plain values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
