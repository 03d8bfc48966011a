"""LogHook: log lines with elapsed time and ETA, one progress bar per run, metrics.jsonl, perf tables; the only sync."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Protocol

import torch

from sslkit.data.health import SkippedSamples
from sslkit.distributed import is_primary
from sslkit.hooks.base import Slot, SSLHook
from sslkit.registry import register_hook
from sslkit.stability import StabilityWatch

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["JsonlSink", "LogHook", "MetricsSink", "format_duration"]

logger = logging.getLogger("sslkit")
#: The clock of elapsed times and ETAs (tests replace it with a fake one).
_now = time.perf_counter


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
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:  # e.g. a full disk, reported at the flush: name the file
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, self.path) from exc
            raise

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

    A record holds ``step, epoch, phase, loss, lr, img_per_s, elapsed_s`` (seconds since this process
    started the run), ``eta_s`` (seconds the rest of the run should take, once a step was timed), the
    loss terms and, in train phases, the value of every schedule at the latest update
    (``task.scheduled``: ``lr``, ``weight_decay`` and the method's own, e.g. ``teacher_momentum``,
    ``teacher_temp``). Log lines say the same, and each train epoch ends with a line such as
    ``epoch 3/10 done: loss 4.1234 lr 0.1 1234 img/s, elapsed 1m23s, ETA 5m12s``.

    With ``progress_bar`` true, one tqdm bar counts the run's optimizer steps (its ETA covers the
    whole run; eval phases do not move it) on ``bar_file`` (default: stderr), and the stream
    handlers of the ``sslkit`` logger write through ``tqdm.write`` while it is shown, so log lines
    go above the bar instead of through it. At each phase end the perf-stats table is logged.
    """

    name = "log"
    slot = Slot.LOG

    def __init__(
        self, every_n_steps: int = 50, progress_bar: bool = False, sinks: list[MetricsSink] | None = None,
        bar_file: IO[str] | None = None,
    ) -> None:
        self.every_n_steps = max(1, every_n_steps)
        self.progress_bar = progress_bar
        self.sinks = sinks or []
        self.bar_file = bar_file
        self._bar: Any = None
        self._wrapped: list[tuple[logging.StreamHandler, IO[str]]] = []  # (handler, its own stream)
        self._t_last = 0.0
        self._samples_since = 0
        self._t_start = _now()  # this process's start of the run (reset in on_start), and its first step
        self._step_at_start = 0
        self._train_epochs = 0
        self._epoch_t0 = 0.0
        self._epoch_samples = 0
        self._epoch_loss_sum = 0.0  # logged losses of the train epoch, weighted by the steps they cover
        self._epoch_loss_steps = 0
        self._last_loss: float | None = None
        self.unreadable = SkippedSamples()
        self.stability = StabilityWatch()
        self._announced = False  # the "training ..." line of this process is out (the first phase start)

    def on_start(self, task: SSLTask) -> None:
        """Start the clock and the run's progress bar; log what is about to run."""
        self._t_start = _now()
        self._step_at_start = task.clock.step
        self._train_epochs = len({p.epoch for p in task.phases if p.train})
        if self.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=task.clock.max_steps, initial=task.clock.step, unit="step", dynamic_ncols=True,
                             desc="train", file=self.bar_file or sys.stderr, leave=True)
            self._route_through_tqdm()
        self._announced = False
        for message in self.stability.start(task):
            for sink in self.sinks:
                sink.write({"step": task.clock.step, "epoch": task.epoch, "phase": "warning",
                            "warning": "fp16_low_temperature", "message": message})
        if task.phase_idx or task.clock.step_in_epoch:
            logger.info("resumed at phase %d, step %d of it, step %d of the run",
                        task.phase_idx, task.clock.step_in_epoch, task.clock.step)
            for sink in self.sinks:
                if isinstance(sink, JsonlSink) and (dropped := sink.truncate_after(task.clock.step)):
                    logger.info("dropped %d records of steps after %d from %s: this run logs them again",
                                dropped, task.clock.step, sink.path)

    def on_phase_start(self, task: SSLTask) -> None:
        """Reset timers and meters, and the train epoch's totals; before the first phase, log what is about to run.

        That line comes after every hook's ``on_start`` (the pre-emption hook's signal handlers, the kNN
        baselines): once it is out, a Ctrl-C finishes the step and writes a checkpoint."""
        if not self._announced:
            self._announced = True
            n_params = sum(p.numel() for p in task.base_model.parameters() if p.requires_grad)
            logger.info(
                "training %d phases, %d optimizer steps, global batch %d, %.2fM trainable parameters, "
                "device %s, AMP %s; output in %s",
                len(task.phases), task.clock.max_steps, task.global_batch_size, n_params / 1e6,
                task.device, task.amp_dtype or "off", task.output_dir,
            )
        task.perf_stats.reset()
        task.loss_sum.zero_()
        task.loss_count = 0
        if task.clock.step_in_epoch == 0:  # a resumed phase keeps the counts restored from the checkpoint
            self.unreadable.reset(task.device)
        self._t_last = _now()
        self._samples_since = 0
        if task.train:
            self._epoch_t0, self._epoch_samples = self._t_last, 0
            self._epoch_loss_sum, self._epoch_loss_steps = 0.0, 0
        if self._bar is not None:
            self._bar.set_description(f"train epoch {task.epoch}" if task.train else f"eval ({task.phase.split})",
                                      refresh=False)

    def on_step(self, task: SSLTask) -> None:
        """Count the step; at the log interval, sync once and write a record."""
        assert task.last_batch is not None
        self.unreadable.update(task.last_batch.sample)
        self._samples_since += task.global_batch_size
        if task.train:
            self._epoch_samples += task.global_batch_size
            if self._bar is not None and task.clock.step > self._bar.n:
                self._bar.update(task.clock.step - self._bar.n)
        if task.train and task.clock.step % self.every_n_steps == 0:
            self._emit(task)

    def on_phase_end(self, task: SSLTask) -> None:
        """Write the phase's last record, log perf stats and skipped samples; a train epoch ends
        with a summary line (loss, lr, img/s, elapsed, ETA)."""
        if task.loss_count:
            self._emit(task)
        report = self.unreadable.report(task.epoch)  # every rank: the counts are summed over ranks
        if report:
            logger.warning(report)
            totals = self.unreadable.totals()
            for sink in self.sinks:
                sink.write({"step": task.clock.step, "epoch": task.epoch, "phase": "train" if task.train else "eval",
                            "unreadable_samples": totals.skipped, "samples": totals.seen,
                            "batches_without_readable_sample": totals.empty_batches})
        self.unreadable.check_all_unreadable(task.epoch)
        logger.info("time per step section, %s epoch %d:\n%s",
                    "train" if task.train else "eval", task.epoch, task.perf_stats.table())
        if task.train:
            logger.info(self._epoch_line(task))

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
        """Close the bar (its last state stays on screen), give the log handlers their streams back,
        close the sinks."""
        self._close_bar()
        for sink in self.sinks:
            sink.close()

    def on_exception(self, task: SSLTask) -> None:
        """Close the bar and give the log handlers their streams back, so the traceback prints cleanly."""
        self._close_bar()

    # ------------------------------------------------------------------------------ helpers
    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for handler, stream in self._wrapped:
            handler.setStream(stream)
        self._wrapped = []

    def _route_through_tqdm(self) -> None:
        """Make the ``sslkit`` logger's stream handlers (not its file handlers) write through
        ``tqdm.write``: the bar is cleared, the line written, the bar drawn again."""
        for handler in logger.handlers:
            if (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
                    and not isinstance(handler.stream, _TqdmStream)):
                self._wrapped.append((handler, handler.stream))
                handler.setStream(_TqdmStream(handler.stream))

    def _timing(self, task: SSLTask, now: float) -> tuple[float, float | None]:
        """Seconds since this process started the run, and the estimated seconds left (None before a
        step is timed): optimizer steps left x the mean time per step so far in this process."""
        elapsed = now - self._t_start
        done = task.clock.step - self._step_at_start
        if done <= 0:
            return elapsed, None
        return elapsed, max(task.clock.max_steps - task.clock.step, 0) * elapsed / done

    def _epoch_line(self, task: SSLTask) -> str:
        now = _now()
        elapsed, eta = self._timing(task, now)
        loss = (self._epoch_loss_sum / self._epoch_loss_steps if self._epoch_loss_steps else self._last_loss)
        shown = f" loss {loss:.4f}" if loss is not None else ""
        total = self._train_epochs
        per_epoch = task.steps_per_phase
        if per_epoch:  # max_steps may end the run before the last train phase
            total = min(total, -(-task.clock.max_steps // per_epoch))
        total = max(total, task.epoch + 1)
        return (f"epoch {task.epoch + 1}/{total} done:{shown} lr {task.optimizer.param_groups[0]['lr']:.4g} "
                f"{self._epoch_samples / max(now - self._epoch_t0, 1e-9):.0f} img/s, "
                f"elapsed {format_duration(elapsed)}, ETA {format_duration(eta)}")

    def _emit(self, task: SSLTask) -> None:
        assert task.last_batch is not None
        metrics = task.last_batch.metrics
        # one host-device sync for the loss and every logged term together
        values = torch.stack([(task.loss_sum / max(task.loss_count, 1)).float(),
                              *[v.detach().float().mean().to(task.loss_sum.device) for v in metrics.values()]]).tolist()
        task.perf_stats.resolve()  # the events of the steps since the last record are done now: no extra wait
        now = _now()
        loss = values[0]
        elapsed, eta = self._timing(task, now)
        record: dict[str, Any] = {
            "step": task.clock.step,
            "epoch": task.epoch,
            "phase": "train" if task.train else "eval",
            "loss": loss,
            "lr": task.scheduled.get("lr", task.optimizer.param_groups[0]["lr"]),
            "img_per_s": self._samples_since / max(now - self._t_last, 1e-9),
            "elapsed_s": round(elapsed, 3),
        }
        if eta is not None:
            record["eta_s"] = round(eta, 3)
        record.update(zip(metrics, values[1:], strict=True))
        if task.train:
            record.update(task.scheduled)  # every schedule's value at this update: lr, weight_decay, teacher_*
        if task.train:
            self._epoch_loss_sum += loss * task.loss_count
            self._epoch_loss_steps += task.loss_count
            self._last_loss = loss
        task.loss_sum.zero_()
        task.loss_count = 0
        self._t_last, self._samples_since = now, 0
        warnings = self.stability.check(task, record) if task.train else []  # known failure modes, once each
        for sink in self.sinks:
            sink.write(record)
            for warning in warnings:
                sink.write(warning)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{record['img_per_s']:.0f}", refresh=False)
        logger.info(f"epoch {record['epoch']} step {record['step']}/{task.clock.max_steps} loss {loss:.4f} "
                    f"lr {record['lr']:.4g} {record['img_per_s']:.0f} img/s, elapsed {format_duration(elapsed)}, "
                    f"ETA {format_duration(eta)}")


class _TqdmStream:
    """A log handler's stream seen through ``tqdm.write``, so that a line clears and redraws the bar."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        """Write ``text`` (a formatted record and its newline) above the progress bar."""
        from tqdm import tqdm

        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        """Flush the wrapped stream."""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno...: the wrapped stream's
        return getattr(self.stream, name)


def format_duration(seconds: float | None) -> str:
    """``83.2`` -> ``1m23s``, ``7380`` -> ``2h03m``; None (not known yet) -> ``?``."""
    if seconds is None:
        return "?"
    s = round(seconds)
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
