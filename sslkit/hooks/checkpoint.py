"""CheckpointHook: saves the whole task state periodically, at epoch ends and at the end of the run."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sslkit.checkpoint import checkpoint_dir, save_checkpoint
from sslkit.distributed import barrier, is_primary
from sslkit.hooks.base import SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["CheckpointHook"]

logger = logging.getLogger("sslkit")


@register_hook("checkpoint")
class CheckpointHook(SSLHook):
    """Save ``task.state_dict()`` every ``every_n_steps`` optimizer steps (0 = never), after every
    ``every_n_epochs`` train epochs (0 = never) and the last one, and once more at the end of
    the run. Runs late (priority 90), so every other hook's state of this step is included.
    Only rank 0 writes; every rank takes part (the RNG states of all ranks are saved).
    """

    priority = 90

    def __init__(self, output_dir: str, every_n_epochs: int = 1, every_n_steps: int = 0, keep_last: int = 3) -> None:
        self.dir = checkpoint_dir(output_dir)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last

    def save(self, task: SSLTask, why: str) -> str | None:
        """Write a checkpoint now; returns its path on rank 0 (None elsewhere).

        Every rank calls it at the same point: the hooks' :meth:`before_checkpoint` runs, the
        state (with every rank's RNG) is gathered, rank 0 writes, and a barrier keeps any rank
        from moving on (or exiting) before the file is complete.
        """
        for hook in task.hooks:
            hook.before_checkpoint(task)
        state = task.state_dict()
        path = None
        if is_primary():
            path = save_checkpoint(state, self.dir, task.iteration, self.keep_last)
            logger.info("saved checkpoint %s (%s)", path, why)
        barrier()
        return path

    def on_step(self, task: SSLTask) -> None:
        """Save at the step interval (train phases)."""
        if task.train and self.every_n_steps > 0 and task.iteration % self.every_n_steps == 0:
            self.save(task, f"step {task.iteration}")

    def on_phase_end(self, task: SSLTask) -> None:
        """Save after every ``every_n_epochs`` train epochs and after the last train phase."""
        if not task.train:
            return
        last_train = not any(p.train for p in task.phases[task.phase_idx + 1 :]) or task.out_of_steps
        epoch_due = self.every_n_epochs > 0 and (task.epoch + 1) % self.every_n_epochs == 0
        if epoch_due or last_train:
            self.save(task, f"end of epoch {task.epoch}")

    def on_end(self, task: SSLTask) -> None:
        """Save the final state, with the results of the hooks that ran at the end (kNN)."""
        self.save(task, "end of run")
