"""PreemptionHook: a signal (Ctrl-C, a scheduler's SIGTERM or SIGUSR1) stops the run after the current step, with a
checkpoint; the trainer then raises :class:`~sslkit.reliability.Preempted`."""

from __future__ import annotations

import logging
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from sslkit.distributed import agree_any, is_primary
from sslkit.hooks.base import Slot, SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["PreemptionHook"]

logger = logging.getLogger("sslkit")


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
    some ranks stops all of them at the same step. It only asks for the stop
    (``task.stop_requested``): the checkpoint hook, in the slot after it, writes the checkpoint, and
    the trainer raises :class:`Preempted`.
    """

    slot = Slot.STOP
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

    def _say(self, message: str, *args: Any) -> None:
        """A warning on rank 0, on the others only at info level: said once, as every rank stops together."""
        (logger.warning if self._primary else logger.info)(message, *args)

    def _stop_if_signalled(self, task: SSLTask) -> None:
        (stop,) = agree_any(self.received is not None)
        if not stop:
            return
        name = self.received.name if self.received is not None else "a signal on another rank"
        self._say("received %s: writing a checkpoint after step %d, then stopping", name, task.clock.step)
        task.stop_requested = name

    def on_step(self, task: SSLTask) -> None:
        """After a train step: if any rank got a signal, ask the run to stop after this step."""
        if task.train and task.clock.step % self.every_n_steps == 0:
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
            self._say("received %s during the final evaluation; the run had finished training and is complete",
                      self.received.name)

    def on_exception(self, task: SSLTask) -> None:
        """Put the previous signal handlers back."""
        self._restore()
