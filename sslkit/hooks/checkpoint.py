"""CheckpointHook: saves the whole task state periodically, at epoch ends and at the end of the run."""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from sslkit.checkpoint import atomic_write, checkpoint_dir, commit, latest_checkpoint, os_error_in, save_checkpoint
from sslkit.checkpointing import sharded as sharded_checkpoint
from sslkit.distributed import barrier, is_distributed, is_primary
from sslkit.errors import storage_error
from sslkit.guard import TrainingHalted
from sslkit.hooks.base import Event, Slot, SSLHook
from sslkit.parallel import is_sharded
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

    ``sharded``: write sharded checkpoint folders (:mod:`sslkit.checkpointing.sharded`), every rank its part, instead
    of one file gathered by rank 0; ``async_save`` then lets the periodic saves write in the background (a stop
    and the end of the run wait for theirs). A folder becomes the latest checkpoint (``latest.txt``) only once
    complete.
    """

    slot = Slot.CHECKPOINT

    def __init__(self, output_dir: str, every_n_epochs: int = 1, every_n_steps: int = 0, keep_last: int = 3,
                 sharded: bool = False, async_save: bool = False) -> None:
        self.dir = checkpoint_dir(output_dir)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.sharded = sharded
        self.async_save = async_save and sharded
        self._pending: tuple[Any, str] | None = None  # an async save in flight: its future and folder name
        self._async_group: Any = None
        self._saved: tuple[int, dict[str, Any]] | None = None  # iteration and hook states of the last save
        self._saved_path: str | None = None

    def save(self, task: SSLTask, why: str, wait: bool = True) -> str | None:
        """Write a checkpoint now; returns its path on rank 0 (None elsewhere).

        Every rank calls it at the same point: the update guard checks that no step so far had a
        non-finite loss (a state past one never becomes a checkpoint), ``before_checkpoint`` fires,
        the state (with every rank's RNG) is gathered, rank 0 writes, and a barrier keeps any rank
        from moving on (or exiting) before the file is complete. Sharded: every rank writes its part;
        ``wait=False`` with ``async_save`` returns once the state is copied, the folder completes later.
        """
        task.guard.check(task)
        task.run_hooks(Event.BEFORE_CHECKPOINT)
        if self.sharded:
            return self._save_sharded(task, why, wait)
        state = task.state_dict()
        path = None
        if is_primary():
            path = save_checkpoint(state, self.dir, task.iteration, self.keep_last)
            logger.info("saved checkpoint %s (%s)", path, why)
        self._saved = (task.iteration, state["hooks"])
        self._saved_path = path
        barrier()
        return path

    def _save_sharded(self, task: SSLTask, why: str, wait: bool) -> str | None:
        self.finish_pending()
        model_state, optimizer_state, extra, own = task.sharded_state_dict()
        name = f"checkpoint_{task.iteration:09d}"
        final = os.path.join(self.dir, name)
        rewrite = sharded_checkpoint.is_complete(final)  # the end of the run updating its last epoch's folder
        path = f"{final}.update" if rewrite else final
        if is_primary():
            os.makedirs(self.dir, exist_ok=True)
            if os.path.isdir(path):  # a save of this step that never finished
                shutil.rmtree(path)
        barrier()
        use_async = self.async_save and not wait and not rewrite
        if use_async and is_distributed() and self._async_group is None:
            import torch.distributed as dist  # its own group: its collectives run beside the training's

            self._async_group = dist.new_group(backend="gloo")
        try:
            future = sharded_checkpoint.save(model_state, optimizer_state, extra if is_primary() else None, path,
                                             rank_state=(task.rank, own),
                                             async_save=use_async, process_group=self._async_group if use_async
                                             else None)
        except sharded_checkpoint.failures() as exc:
            self._raise_storage(exc, path)
            raise
        self._saved = (task.iteration, extra["hooks"])
        self._saved_path = final if is_primary() else None
        if future is not None:
            self._pending = (future, name)
            logger.info("writing checkpoint %s in the background (%s)", final, why)
            return self._saved_path
        if rewrite and is_primary():
            os.replace(final, f"{final}.old")
            os.replace(path, final)
            shutil.rmtree(f"{final}.old")
        self._commit(name)
        if is_primary():
            logger.info("saved checkpoint %s (%s)", final, why)
        return self._saved_path

    def _raise_storage(self, exc: BaseException, path: str) -> None:
        """A full disk (or another storage error) while writing ``path``, in the chain of ``exc`` or among a
        torch.distributed.checkpoint error's per-rank failures: raised as sslkit's StorageError."""
        causes = [exc, *getattr(exc, "failures", {}).values()]
        for cause in causes:
            found = os_error_in(cause) if isinstance(cause, BaseException) else None
            if found is not None:
                raise storage_error(found, "the checkpoint", path, latest_checkpoint(self.dir)) from exc

    def _commit(self, name: str) -> None:
        """Rank 0 points latest.txt at the complete folder ``name`` and prunes old ones; then every rank goes on."""
        if is_primary():
            commit(self.dir, name, self.keep_last)
        barrier()

    def finish_pending(self) -> None:
        """Wait for the background save in flight, if any, and make it the latest checkpoint. Every rank calls it."""
        if self._pending is None:
            return
        future, name = self._pending
        self._pending = None
        try:
            future.result()
        except sharded_checkpoint.failures() as exc:
            self._raise_storage(exc, os.path.join(self.dir, name))
            raise
        self._commit(name)
        if is_primary():
            logger.info("saved checkpoint %s (written in the background)", os.path.join(self.dir, name))

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
            self.save(task, f"step {task.iteration}", wait=False)
        self._save_for_stop(task)

    def _save_for_stop(self, task: SSLTask) -> None:
        if task.stop_requested is not None:
            self.finish_pending()
            task.stop_checkpoint = self.save_once(task, f"pre-emption by {task.stop_requested}")

    def on_halt(self, task: SSLTask) -> None:
        """The update guard halted the run: write the state at the stop as ``crash_<step>.pt`` (rank 0, no
        collective: this is an error path, so only rank 0's RNG state is in it) and name, in the error, that
        file and the checkpoint a rerun resumes from (``latest.txt`` keeps naming the last good one)."""
        exc = task.exception
        if not isinstance(exc, TrainingHalted):
            return
        if is_primary() or is_sharded(task.model):  # under FSDP2 the model is gathered: every rank takes part
            state = task.state_dict(gather_rng=False)
        if is_primary():
            os.makedirs(self.dir, exist_ok=True)
            path = os.path.join(self.dir, f"crash_{task.iteration:09d}.pt")
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
            self.save(task, f"end of epoch {task.epoch}", wait=last_train)
        self._save_for_stop(task)

    def on_end(self, task: SSLTask) -> None:
        """Save the final state, with the results of the hooks that ran at the end (kNN), unless the
        checkpoint of this step already holds it."""
        self.finish_pending()
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
