"""How a run stops early: the Preempted error a pre-emption signal ends in (its hook: sslkit/hooks/preemption.py), and
the halts of the update guard (sslkit/guard.py), named for the launcher."""

from __future__ import annotations

from sslkit.guard import NonFiniteLossError, OutOfMemoryHalt, TrainingHalted

__all__ = [
    "NonFiniteLossError",
    "OutOfMemoryHalt",
    "Preempted",
    "TrainingHalted",
    "last_stop_signal",
]

#: The signal of the last pre-emption in this process (``signal``), if there was one.
_LAST_STOP: dict[str, str] = {}


def last_stop_signal() -> str | None:
    """The name of the signal that pre-empted the last run in this process (``SIGUSR2``, ...), or None."""
    return _LAST_STOP.get("signal")


class Preempted(Exception):
    """Raised on every rank after a pre-emption signal, once the step and its checkpoint are done."""

    def __init__(self, signal_name: str, step: int, path: str | None) -> None:
        _LAST_STOP["signal"] = signal_name  # (a SLURM task requeues its job after SIGUSR2: last_stop_signal)
        self.signal_name = signal_name
        self.step = step
        self.path = path
        where = f" to {path}" if path else ""
        super().__init__(
            f"stopped by {signal_name} after step {step}; the checkpoint was written{where}. "
            "Run the same command again to resume from it."
        )
