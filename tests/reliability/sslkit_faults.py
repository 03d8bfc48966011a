"""Fault injection for the reliability tests, loaded into real runs with ``imports=[sslkit_faults]``."""

from __future__ import annotations

import os
import signal

import torch

from sslkit.hooks.base import Slot, SSLHook
from sslkit.registry import register_hook


class _Fault(SSLHook):
    """Fires at optimizer step ``step`` (1-based) on ``rank`` (-1: every rank); with ``once`` only
    in a run that started from scratch, so that the resumed run of the same command goes through."""

    def __init__(self, step: int, rank: int = -1, once: bool = True) -> None:
        self.step = step
        self.rank = rank
        self.once = once
        self.fresh = True

    def on_start(self, task) -> None:
        self.fresh = task.clock.step == 0

    def due(self, task) -> bool:
        return (task.train and task.clock.step + 1 == self.step and (self.rank < 0 or task.rank == self.rank)
                and (self.fresh or not self.once))


@register_hook("fault_signal")
class SignalFault(_Fault):
    """Sends ``signal`` to this process after step ``step`` (before the pre-emption check)."""

    slot = Slot.EVAL  # after the step's log line, before the pre-emption check and the checkpoint

    def __init__(self, step: int, signal: str = "SIGKILL", rank: int = -1, once: bool = True) -> None:
        super().__init__(step, rank, once)
        self.signal = signal

    def on_step(self, task) -> None:
        if task.train and task.clock.step == self.step and (self.rank < 0 or task.rank == self.rank) and self.fresh:
            os.kill(os.getpid(), getattr(signal, self.signal))


@register_hook("fault_nan")
class NaNFault(_Fault):
    """Turns the model's projections into NaN in the forward of step ``step``."""

    def on_forward(self, task) -> None:
        if self.due(task):
            out = task.last_batch.model_output
            out["projections"] = [p * float("nan") for p in out["projections"]]


@register_hook("fault_oom")
class OOMFault(_Fault):
    """Raises torch.OutOfMemoryError at step ``step``: in the forward hooks (``where: forward``) or
    from inside autograd's backward (``where: backward``, a gradient hook on the loss)."""

    def __init__(self, step: int, rank: int = -1, once: bool = False, where: str = "forward") -> None:
        super().__init__(step, rank, once)
        self.where = where

    def on_forward(self, task) -> None:
        if self.where == "forward" and self.due(task):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")

    def on_loss_and_meter(self, task) -> None:
        if self.where == "backward" and self.due(task):
            def boom(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("CUDA out of memory in backward (simulated)")

            task.last_batch.loss.register_hook(boom)


@register_hook("fault_crash")
class CrashFault(_Fault):
    """Raises after step ``step`` (a crash: the process loses everything since the last checkpoint)."""

    slot = Slot.EVAL  # after the step's log line, before the pre-emption check and the checkpoint

    def on_step(self, task) -> None:
        if task.train and task.clock.step == self.step and (self.rank < 0 or task.rank == self.rank) and self.fresh:
            raise RuntimeError(f"injected crash after step {self.step}")


@register_hook("fault_block")
class BlockFault(_Fault):
    """Blocks in the forward of train step ``step`` (a step that does not end by itself), after creating the file
    ``marker``: a test waits for that file, then acts on the run (signals it, kills it) while it is inside that step,
    however fast or slow the machine. The block ends when the file ``release`` appears (if one is named) or with a
    KeyboardInterrupt (a second Ctrl-C); after ``hang_s`` seconds it raises, so a test that never acts fails
    instead of hanging. ``once``: only in a run that started from scratch (else also in a resumed one)."""

    def __init__(self, step: int, marker: str, release: str = "", once: bool = True, hang_s: float = 600.0) -> None:
        super().__init__(step, -1, once)
        self.marker = marker
        self.release = release
        self.hang_s = hang_s

    def on_forward(self, task) -> None:
        import time

        if not self.due(task):
            return
        open(self.marker, "w").close()
        end = time.monotonic() + self.hang_s
        while time.monotonic() < end:
            if self.release and os.path.exists(self.release):
                return
            time.sleep(0.05)
        raise RuntimeError(f"fault_block: nothing stopped the run within {self.hang_s:.0f} s of step {self.step}")


@register_hook("fault_full_disk")
class FullDiskFault(_Fault):
    """Makes the checkpoint of step ``step`` hit a full disk: its temporary file is made a link to /dev/full,
    where every write fails with ENOSPC (before the checkpoint hook writes it)."""

    slot = Slot.MONITOR  # before the checkpoint hook writes

    def __init__(self, step: int, file: str = "checkpoint") -> None:
        super().__init__(step)
        self.file = file  # "checkpoint" or "metrics" (metrics.jsonl becomes a link to /dev/full)

    def on_step(self, task) -> None:
        if task.train and task.clock.step == self.step and task.rank == 0:
            from sslkit.checkpoint import checkpoint_dir

            if self.file == "metrics":
                path = os.path.join(task.output_dir, "metrics.jsonl")
                os.replace(path, path + ".before")
                os.symlink("/dev/full", path)
                return
            folder = checkpoint_dir(task.output_dir)
            os.makedirs(folder, exist_ok=True)
            os.symlink("/dev/full", os.path.join(folder, f"checkpoint_{self.step:09d}.pt.tmp.{os.getpid()}"))


@register_hook("record_samples")
class RecordSamples(SSLHook):
    """Appends, per micro-batch, ``iteration micro index index ...`` (the dataset indices this rank trained on) to
    ``<output_dir>/samples.<rank>.txt``: what the elastic-resume tests compare."""

    def on_forward(self, task) -> None:
        if not task.train:
            return
        indices = task.last_batch.sample["data_idx"].reshape(-1).tolist()
        path = os.path.join(task.output_dir, f"samples.{task.rank}.txt")
        with open(path, "a") as f:
            f.write(" ".join(str(v) for v in (task.clock.step, task.clock.micro_batch, *indices)) + "\n")
