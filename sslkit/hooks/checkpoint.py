"""CheckpointHook: saves the whole task state periodically, at epoch ends and at the end of the run."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from sslkit.checkpoint import atomic_write, checkpoint_dir, latest_checkpoint, save_checkpoint
from sslkit.distributed import barrier, is_primary
from sslkit.guard import TrainingHalted
from sslkit.hooks.base import Event, Slot, SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["CheckpointHook"]

logger = logging.getLogger("sslkit")


@register_hook("checkpoint")
class CheckpointHook(SSLHook):
    """Save ``task.state_dict()`` every ``every_n_steps`` optimizer steps (0 = never), after every
    ``every_n_epochs`` train epochs (0 = never) and the last one, and once more at the end of
    the run, and when the run is asked to stop (``task.stop_requested``, a pre-emption). It runs in
    the last slot, so every other hook's state of this step is included. Only rank 0 writes; every
    rank takes part (the RNG states of all ranks are saved). When the update guard halts the run,
    ``on_halt`` writes the state at the stop as ``crash_<step>.pt`` (for inspection, never resumed
    from) and names the checkpoint a rerun resumes from.

    The end of the last epoch and the end of the run are the same step: the end-of-run save
    rewrites that file only if a hook's state changed in between (the final kNN results), and
    logs it as an update naming those hooks; otherwise nothing is written or logged twice.
    """

    slot = Slot.CHECKPOINT

    def __init__(self, output_dir: str, every_n_epochs: int = 1, every_n_steps: int = 0, keep_last: int = 3) -> None:
        self.dir = checkpoint_dir(output_dir)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self._saved: tuple[int, dict[str, Any]] | None = None  # iteration and hook states of the last save
        self._saved_path: str | None = None

    def save(self, task: SSLTask, why: str) -> str | None:
        """Write a checkpoint now; returns its path on rank 0 (None elsewhere).

        Every rank calls it at the same point: the update guard checks that no step so far had a
        non-finite loss (a state past one never becomes a checkpoint), ``before_checkpoint`` fires,
        the state (with every rank's RNG) is gathered, rank 0 writes, and a barrier keeps any rank
        from moving on (or exiting) before the file is complete.
        """
        task.guard.check(task)
        task.run_hooks(Event.BEFORE_CHECKPOINT)
        state = task.state_dict()
        path = None
        if is_primary():
            path = save_checkpoint(state, self.dir, task.iteration, self.keep_last)
            logger.info("saved checkpoint %s (%s)", path, why)
        self._saved = (task.iteration, state["hooks"])
        self._saved_path = path
        barrier()
        return path

    def save_once(self, task: SSLTask, why: str) -> str | None:
        """:meth:`save`, unless the checkpoint of this step with these hook states is written already
        (e.g. at the end of an epoch): then its path (rank 0) is returned and nothing is written."""
        if self._saved is not None and self._saved[0] == task.iteration and not self._changed(task):
            return self._saved_path
        return self.save(task, why)

    def _changed(self, task: SSLTask) -> list[str]:
        """Names of the hooks whose state differs from that in the last save."""
        assert self._saved is not None
        before, now = self._saved[1], task.hook_states()
        return [name for name, state in now.items() if not _same(before.get(name), state)]

    def on_start(self, task: SSLTask) -> None:
        """A resumed run stands where its checkpoint was written: nothing to save there again unless a hook's
        state changes (a finished run started again writes nothing)."""
        if task.iteration > 0:
            self._saved = (task.iteration, task.hook_states())
            self._saved_path = latest_checkpoint(self.dir) if is_primary() else None

    def on_step(self, task: SSLTask) -> None:
        """Save at the step interval (train phases), and when the run is asked to stop."""
        if task.train and self.every_n_steps > 0 and task.iteration % self.every_n_steps == 0:
            self.save(task, f"step {task.iteration}")
        self._save_for_stop(task)

    def _save_for_stop(self, task: SSLTask) -> None:
        if task.stop_requested is not None:
            task.stop_checkpoint = self.save_once(task, f"pre-emption by {task.stop_requested}")

    def on_halt(self, task: SSLTask) -> None:
        """The update guard halted the run: write the state at the stop as ``crash_<step>.pt`` (rank 0, no
        collective: this is an error path, so only rank 0's RNG state is in it) and name, in the error, that
        file and the checkpoint a rerun resumes from (``latest.txt`` keeps naming the last good one)."""
        exc = task.exception
        if not isinstance(exc, TrainingHalted):
            return
        if is_primary():
            os.makedirs(self.dir, exist_ok=True)
            path = os.path.join(self.dir, f"crash_{task.iteration:09d}.pt")
            state = task.state_dict(gather_rng=False)
            state["crash"] = exc.message
            atomic_write(path, lambda f: torch.save(state, f))
            exc.crash_path = path
        exc.resume_from = latest_checkpoint(self.dir)
        exc.checked_checkpoints = True

    def on_phase_end(self, task: SSLTask) -> None:
        """Save after every ``every_n_epochs`` train epochs and after the last train phase."""
        if not task.train:
            return
        last_train = not any(p.train for p in task.phases[task.phase_idx + 1 :]) or task.out_of_steps
        epoch_due = self.every_n_epochs > 0 and (task.epoch + 1) % self.every_n_epochs == 0
        if epoch_due or last_train:
            self.save(task, f"end of epoch {task.epoch}")
        self._save_for_stop(task)

    def on_end(self, task: SSLTask) -> None:
        """Save the final state, with the results of the hooks that ran at the end (kNN), unless the
        checkpoint of this step already holds it."""
        if self._saved is not None and self._saved[0] == task.iteration:
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
