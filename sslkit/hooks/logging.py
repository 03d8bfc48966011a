"""LogHook: log lines, a progress bar, metrics.jsonl and perf-stats tables; the only place that syncs."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sslkit.data.health import SkippedSamples
from sslkit.distributed import is_primary
from sslkit.hooks.base import SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["JsonlSink", "LogHook", "MetricsSink"]

logger = logging.getLogger("sslkit")


class MetricsSink(Protocol):
    """Something that takes one record of metrics (a flat dict with ``step``)."""

    def write(self, record: dict[str, Any]) -> None:
        """Store ``record``."""

    def close(self) -> None:
        """Flush and release resources."""


class JsonlSink:
    """Appends one JSON object per record to ``<output_dir>/metrics.jsonl`` (resumed runs append)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Nothing to release: every write opens and closes the file."""

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps after ``step`` (logged by a run killed after its last checkpoint,
        and about to be logged again by the resumed run); returns how many were dropped. The file
        is rewritten atomically (temporary file, rename)."""
        if not os.path.exists(self.path):
            return 0
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) > step:
                    continue
            except json.JSONDecodeError:  # a line torn by the kill
                continue
            keep.append(line if line.endswith("\n") else line + "\n")
        if len(keep) != len(lines):
            tmp = f"{self.path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(keep)
            os.replace(tmp, self.path)
        return len(lines) - len(keep)


@register_hook("log")
class LogHook(SSLHook):
    """Every ``every_n_steps`` optimizer steps (and at each phase end): read the loss meter
    (the one host-device sync), log a line, write a record to each sink.

    A record holds ``step, epoch, phase, loss, lr, img_per_s`` and the loss terms. A tqdm
    progress bar (ETA, img/s) is shown when ``progress_bar`` is true; log lines otherwise.
    At each phase end the perf-stats table is logged.
    """

    name = "log"
    priority = 50

    def __init__(
        self, every_n_steps: int = 50, progress_bar: bool = False, sinks: list[MetricsSink] | None = None
    ) -> None:
        self.every_n_steps = max(1, every_n_steps)
        self.progress_bar = progress_bar
        self.sinks = sinks or []
        self._bar: Any = None
        self._t_last = 0.0
        self._samples_since = 0
        self.unreadable = SkippedSamples()

    def on_start(self, task: SSLTask) -> None:
        """Log what is about to run."""
        n_params = sum(p.numel() for p in task.base_model.parameters() if p.requires_grad)
        logger.info(
            "training %d phases, %d optimizer steps, global batch %d, %.2fM trainable parameters, "
            "device %s, AMP %s; output in %s",
            len(task.phases), task.max_iterations, task.global_batch_size, n_params / 1e6,
            task.device, task.amp_dtype or "off", task.output_dir,
        )
        if task.phase_idx or task.steps_in_phase:
            logger.info("resumed at phase %d, step %d of it, iteration %d",
                        task.phase_idx, task.steps_in_phase, task.iteration)
            for sink in self.sinks:
                if isinstance(sink, JsonlSink) and (dropped := sink.truncate_after(task.iteration)):
                    logger.info("dropped %d records of steps after %d from %s: this run logs them again",
                                dropped, task.iteration, sink.path)

    def on_phase_start(self, task: SSLTask) -> None:
        """Reset timers and meters; open a progress bar."""
        task.perf_stats.reset()
        task.loss_sum.zero_()
        task.loss_count = 0
        if task.steps_in_phase == 0:  # a resumed phase keeps the counts restored from the checkpoint
            self.unreadable.reset(task.device)
        self._t_last = time.perf_counter()
        self._samples_since = 0
        if self.progress_bar:
            from tqdm import tqdm

            total = len(task.loader) + task.steps_in_phase
            kind = "train" if task.train else "eval"
            self._bar = tqdm(total=total, initial=task.steps_in_phase, unit="step", dynamic_ncols=True,
                             desc=f"{kind} epoch {task.epoch}", file=sys.stderr, leave=False)

    def on_step(self, task: SSLTask) -> None:
        """Count the step; at the log interval, sync once and write a record."""
        assert task.last_batch is not None
        self.unreadable.update(task.last_batch.sample)
        self._samples_since += task.global_batch_size
        if self._bar is not None:
            self._bar.update(1)
        if task.train and task.iteration % self.every_n_steps == 0:
            self._emit(task)

    def on_phase_end(self, task: SSLTask) -> None:
        """Write the phase's last record, close the bar, log perf stats and skipped samples."""
        if task.loss_count:
            self._emit(task)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        report = self.unreadable.report(task.epoch)  # every rank: the counts are summed over ranks
        if report:
            logger.warning(report)
            totals = self.unreadable.totals()
            for sink in self.sinks:
                sink.write({"step": task.iteration, "epoch": task.epoch, "phase": "train" if task.train else "eval",
                            "unreadable_samples": totals.skipped, "samples": totals.seen,
                            "batches_without_readable_sample": totals.empty_batches})
        self.unreadable.check_all_unreadable(task.epoch)
        logger.info("%s epoch %d done; time per step section:\n%s",
                    "train" if task.train else "eval", task.epoch, task.perf_stats.table())

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's unreadable-sample counts of the current epoch, so that a resumed epoch reports
        them too (no collective here: crash checkpoints are written by rank 0 alone)."""
        return {"unreadable": self.unreadable.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on rank 0 (the other ranks' counts before the checkpoint are
        not kept: a resumed epoch's report can miss some of their unreadable samples)."""
        if "unreadable" in state and is_primary():
            self.unreadable.load_state_dict(state["unreadable"])

    def on_end(self, task: SSLTask) -> None:
        """Close the sinks."""
        for sink in self.sinks:
            sink.close()

    def on_exception(self, task: SSLTask) -> None:
        """Close the bar so the traceback prints cleanly."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _emit(self, task: SSLTask) -> None:
        assert task.last_batch is not None
        metrics = task.last_batch.metrics
        # one host-device sync for the loss and every logged term together
        values = torch.stack([(task.loss_sum / max(task.loss_count, 1)).float(),
                              *[v.detach().float().mean().to(task.loss_sum.device) for v in metrics.values()]]).tolist()
        task.perf_stats.resolve()  # the events of the steps since the last record are done now: no extra wait
        now = time.perf_counter()
        loss = values[0]
        record: dict[str, Any] = {
            "step": task.iteration,
            "epoch": task.epoch,
            "phase": "train" if task.train else "eval",
            "loss": loss,
            "lr": task.optimizer.param_groups[0]["lr"],
            "img_per_s": self._samples_since / max(now - self._t_last, 1e-9),
        }
        record.update(zip(metrics, values[1:], strict=True))
        task.loss_sum.zero_()
        task.loss_count = 0
        self._t_last, self._samples_since = now, 0
        for sink in self.sinks:
            sink.write(record)
        msg = (f"epoch {record['epoch']} step {record['step']}/{task.max_iterations} loss {loss:.4f} "
               f"lr {record['lr']:.4g} {record['img_per_s']:.0f} img/s")
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{record['img_per_s']:.0f}")
            file_only(msg)
        else:
            logger.info(msg)


def file_only(msg: str) -> None:
    """Log ``msg`` to the file handlers only (the progress bar owns the terminal)."""
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, (), None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
