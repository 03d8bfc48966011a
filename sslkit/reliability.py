"""What keeps a run's work safe: pre-emption signals, the non-finite loss guard, dropped updates, halts."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from sslkit.checkpoint import atomic_write, checkpoint_dir, latest_checkpoint
from sslkit.distributed import agree_any, is_primary
from sslkit.hooks.base import SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "NonFiniteLossError",
    "NonFiniteLossHook",
    "OutOfMemoryHalt",
    "Preempted",
    "PreemptionHook",
    "TrainingHalted",
    "drop_update",
    "halt",
    "restore_buffers",
    "save_crash_checkpoint",
    "snapshot_buffers",
]

logger = logging.getLogger("sslkit")

#: Exit status of a pre-empted run (EX_TEMPFAIL: "try again later"): its checkpoint is written
#: and the same command resumes it.
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """Raised on every rank after a pre-emption signal, once the step and its checkpoint are done."""

    def __init__(self, signal_name: str, iteration: int, path: str | None) -> None:
        self.signal_name = signal_name
        self.iteration = iteration
        self.path = path
        where = f" to {path}" if path else ""
        super().__init__(
            f"stopped by {signal_name} after step {iteration}; the checkpoint was written{where}. "
            "Run the same command again to resume from it."
        )


class TrainingHalted(RuntimeError):
    """A run stopped on purpose by a reliability policy; the message says why and what to do."""


class NonFiniteLossError(TrainingHalted):
    """The loss became NaN or infinite (policy ``halt``, or too many skipped steps in a row)."""


class OutOfMemoryHalt(TrainingHalted):
    """Out of memory in a train step (policy ``halt``, or too many skipped steps in a row)."""


# ---------------------------------------------------------------------------------------- halts
def save_crash_checkpoint(task: SSLTask, why: str) -> str | None:
    """Write the current state as ``checkpoints/crash_<iteration>.pt`` for inspection (rank 0).

    It is not a resume point: ``latest.txt`` keeps naming the last good checkpoint, and the file
    name does not match the pattern auto-resume reads. No collective runs here (this is an error
    path), so only rank 0's RNG state is in it.
    """
    if not is_primary():
        return None
    ckpt = checkpoint_dir(task.output_dir)
    os.makedirs(ckpt, exist_ok=True)
    path = os.path.join(ckpt, f"crash_{task.iteration:09d}.pt")
    state = task.state_dict(gather_rng=False)
    state["crash"] = why
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def halt(task: SSLTask, message: str, error: type[TrainingHalted] = TrainingHalted) -> None:
    """Write a crash checkpoint and raise ``error`` with ``message``, where the crash state is and
    which checkpoint a rerun of the same command resumes from."""
    crash = save_crash_checkpoint(task, message)
    latest = latest_checkpoint(checkpoint_dir(task.output_dir))
    parts = [message]
    if crash:
        parts.append(f"The state at the stop is in {crash} (for inspection; it is never resumed from).")
    if latest:
        parts.append(f"Running the same command resumes from the last good checkpoint, {latest}.")
    else:
        parts.append("No checkpoint was written before the stop: a rerun starts from the beginning.")
    raise error(" ".join(parts))


# ------------------------------------------------------------------------------ dropped updates
def snapshot_buffers(task: SSLTask) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) for every buffer of the model and the loss: what a forward may change."""
    buffers = [b for module in (task.base_model, task.loss) for b in module.buffers()]
    return [(b, b.detach().clone()) for b in buffers]


def restore_buffers(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put back the buffers of :func:`snapshot_buffers`."""
    with torch.no_grad():
        for buffer, copy in snapshot:
            buffer.copy_(copy)


def drop_update(task: SSLTask, snapshot: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """Drop this step's update (``task.skip_update`` says why): discard the gradients, restore the
    buffers, count it; halt once ``task.max_consecutive_skips`` steps in a row were dropped.

    Every rank reaches the same decision (the loss checked is the all-reduced one; an
    out-of-memory error is agreed on), so the ranks stay in step.
    """
    reason = task.skip_update or "unknown"
    task.skip_update = None
    task.optimizer.zero_grad(set_to_none=True)
    if snapshot is not None:
        restore_buffers(snapshot)
    task.skipped_steps[reason] = task.skipped_steps.get(reason, 0) + 1
    task.consecutive_skips += 1
    logger.warning("step %d: update dropped (%s); %d dropped so far for this reason, %d in a row",
                   task.iteration + 1, reason, task.skipped_steps[reason], task.consecutive_skips)
    if task.consecutive_skips >= task.max_consecutive_skips:
        error = OutOfMemoryHalt if reason == "out of memory" else NonFiniteLossError
        halt(task, f"step {task.iteration + 1}: {task.consecutive_skips} updates in a row were dropped "
                   f"({reason}), reliability.max_consecutive_skips={task.max_consecutive_skips}. "
                   "The run is not recovering: lower optim.lr or data.batch_size, or check the data.", error)


# --------------------------------------------------------------------------------- pre-emption
@register_hook("preemption")
class PreemptionHook(SSLHook):
    """On one of ``signals`` (Ctrl-C's SIGINT; SIGTERM and SIGUSR1, what SLURM and cloud schedulers
    send before they stop a job) the run finishes the current step, writes a checkpoint and raises
    :class:`Preempted`; ``tools/run.py`` then exits with status 75 and says how to resume. A second
    SIGINT stops at once (``KeyboardInterrupt``, exit 130, no new checkpoint). A signal that comes
    between train phases (during an evaluation) stops the run at the end of that phase, after its
    checkpoint.

    The signal may reach the main process alone or the whole process group (a terminal's Ctrl-C, a
    scheduler): the loader workers ignore these signals (:func:`sslkit.data.loader.ignore_signals_in_worker`) and let
    the main process decide. Ranks agree on the stop through a small CPU all-reduce every
    ``every_n_steps`` train steps (one process: a flag read, free), so a signal that reaches only
    some ranks stops all of them at the same step. Runs after the checkpoint hook (priority 95).
    """

    priority = 95
    #: A SIGINT this soon after the first is the same press (a group signal passed on by a launcher too).
    REPEAT_S = 0.5

    def __init__(self, signals: tuple[str, ...] | list[str] = ("SIGINT", "SIGTERM", "SIGUSR1"),
                 every_n_steps: int = 1) -> None:
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s) for s in signals]
        self.every_n_steps = max(1, every_n_steps)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._primary = True
        self._first_at = 0.0

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        if sig == signal.SIGINT and self.received == signal.SIGINT and now - self._first_at > self.REPEAT_S:
            raise KeyboardInterrupt  # the second Ctrl-C: stop at once
        if self.received is None:
            self.received, self._first_at = sig, now
            if self._primary:
                again = " (Ctrl-C again to stop at once, without it)" if sig == signal.SIGINT else ""
                print(f"\nsslkit: {sig.name}: finishing this step, then writing a checkpoint and stopping{again}",
                      file=sys.stderr, flush=True)

    def on_start(self, task: SSLTask) -> None:
        """Install the signal handlers (main thread only; elsewhere warn that signals are not caught)."""
        self._primary = is_primary()
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        except ValueError:  # not the main thread of the main interpreter
            logger.warning("pre-emption signals are not handled: the run is not in the main thread")

    def _stop_if_signalled(self, task: SSLTask) -> None:
        (stop,) = agree_any(self.received is not None)
        if not stop:
            return
        name = self.received.name if self.received is not None else "a signal on another rank"
        logger.warning("received %s: writing a checkpoint after step %d, then stopping", name, task.iteration)
        from sslkit.hooks.checkpoint import CheckpointHook

        saver = next((h for h in task.hooks if isinstance(h, CheckpointHook)), None)
        path = saver.save_once(task, f"pre-emption by {name}") if saver is not None else None
        raise Preempted(name, task.iteration, path)

    def on_step(self, task: SSLTask) -> None:
        """After a train step: if any rank got a signal, checkpoint and raise :class:`Preempted`."""
        if task.train and task.iteration % self.every_n_steps == 0:
            self._stop_if_signalled(task)

    def on_phase_end(self, task: SSLTask) -> None:
        """After a phase (and its evaluations and checkpoint): stop if a signal came meanwhile."""
        self._stop_if_signalled(task)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def on_end(self, task: SSLTask) -> None:
        """Put the previous signal handlers back (a signal during the final evaluation: the run is complete)."""
        self._restore()
        if self.received is not None:
            logger.warning("received %s during the final evaluation; the run had finished training and is complete",
                           self.received.name)

    def on_exception(self, task: SSLTask) -> None:
        """Put the previous signal handlers back."""
        self._restore()


# --------------------------------------------------------------------------- non-finite loss
@register_hook("nonfinite_loss")
class NonFiniteLossHook(SSLHook):
    """Watches the all-reduced loss of every train step for NaN or infinity.

    * ``halt`` (default): the check stays on the device (no host sync per step); the flag, the
      first bad step, its loss terms and its samples' indices are read every ``every_n_steps``
      steps (the log interval, where logging syncs anyway), at the end of each epoch and before
      any checkpoint. Then a crash checkpoint is written and :class:`NonFiniteLossError` names
      the step, the terms and the indices. Because a checkpoint is never taken after a bad step,
      the last regular checkpoint is always clean and the same command resumes from it.
    * ``skip``: the flag is read once per step before the optimizer step (one host sync, the
      same one a float16 GradScaler makes), and a bad step's update is dropped (gradients
      discarded, buffers such as BatchNorm statistics and queues restored); the run halts after
      ``max_consecutive_skips`` in a row (see :func:`drop_update`).
    """

    priority = 40

    def __init__(self, policy: str = "halt", every_n_steps: int = 50) -> None:
        if policy not in ("halt", "skip"):
            raise ValueError(f"reliability.nonfinite_loss must be 'halt' or 'skip', got {policy!r}")
        self.policy = policy
        self.every_n_steps = max(1, every_n_steps)
        self._bad: torch.Tensor | None = None  # any bad step seen (halt) / this step bad (skip)
        self._step: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._indices: torch.Tensor | None = None
        self._names: list[str] = []

    def on_loss_and_meter(self, task: SSLTask) -> None:
        """Record on the device whether this micro-batch's loss is finite (no host sync)."""
        if not task.train or task.last_batch is None or task.last_batch.reduced_loss is None:
            return
        lb = task.last_batch
        bad = ~torch.isfinite(lb.reduced_loss)
        if self._bad is None:
            self._bad = torch.zeros((), dtype=torch.bool, device=bad.device)
        first = bad & ~self._bad
        names = ["loss", *sorted(lb.metrics)]
        values = torch.stack([lb.reduced_loss.float(), *[lb.metrics[n].float().mean() for n in names[1:]]])
        indices = lb.sample.get("data_idx")
        if self._values is None or self._values.shape != values.shape:
            self._names, self._values = names, values.clone()
            self._step = torch.full((), -1, dtype=torch.int64, device=bad.device)
        self._values = torch.where(first, values, self._values)
        self._step = torch.where(first, task.iteration + 1, self._step)
        if isinstance(indices, torch.Tensor):
            indices = indices.to(bad.device)
            if self._indices is None or self._indices.shape != indices.shape:
                self._indices = indices.clone()
            self._indices = torch.where(first, indices, self._indices)
        self._bad = self._bad | bad

    def _describe(self) -> str:
        assert self._values is not None and self._step is not None
        terms = ", ".join(f"{n}={v:.6g}" for n, v in zip(self._names, self._values.tolist(), strict=True))
        where = f"step {int(self._step)}: the loss is not finite ({terms})"
        if self._indices is not None:
            where += f"; that batch's sample indices (data_idx) on this rank: {self._indices.tolist()}"
        return where

    def _reset(self) -> None:
        self._bad = None
        self._values = None
        self._indices = None

    def on_backward(self, task: SSLTask) -> None:
        """Policy ``skip``: drop the update of a step whose loss is not finite."""
        if self.policy != "skip" or self._bad is None:
            return
        if bool(self._bad):  # the one host sync per step of this policy
            logger.warning("%s; dropping the update", self._describe())
            task.skip_update = "non-finite loss"
        self._reset()

    def check(self, task: SSLTask) -> None:
        """Policy ``halt``: if any step so far had a non-finite loss, write a crash checkpoint and raise."""
        if self.policy != "halt" or self._bad is None or not bool(self._bad):
            return
        message = self._describe()
        self._reset()
        halt(task, f"{message}. Policy reliability.nonfinite_loss=halt: lower optim.lr, check those samples, "
                   "or set reliability.nonfinite_loss=skip.", NonFiniteLossError)

    def on_step(self, task: SSLTask) -> None:
        """Read the flag at the log interval (halt)."""
        if task.train and task.iteration % self.every_n_steps == 0:
            self.check(task)

    def on_phase_end(self, task: SSLTask) -> None:
        """Read the flag at the end of every epoch (halt)."""
        self.check(task)

    def before_checkpoint(self, task: SSLTask) -> None:
        """Never let a state past a non-finite loss become a checkpoint."""
        self.check(task)
