"""TensorboardSink: writes the log hook's records as TensorBoard scalars."""

from __future__ import annotations

from typing import Any

__all__ = ["TensorboardSink"]


class TensorboardSink:
    """Every numeric field of a record becomes a scalar ``<phase>/<field>`` at its ``step``."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict[str, Any]) -> None:
        """Add the record's numbers as scalars."""
        step = int(record.get("step", 0))
        prefix = record.get("phase", "eval")
        if prefix == "warning":  # text (sslkit.stability): in the log, metrics.jsonl and report.md
            return
        for key, value in record.items():
            if key in ("step", "phase") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        """Flush the event file."""
        self.writer.flush()
