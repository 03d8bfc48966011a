"""UpdateGuard: the one place that decides what happens to an update that ran out of memory or is not finite."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import nn

from sslkit.distributed import agree_any

__all__ = ["GuardedTask", "NonFiniteLossError", "OutOfMemoryHalt", "TrainingHalted", "UpdateGuard"]

logger = logging.getLogger("sslkit")

OUT_OF_MEMORY = "out of memory"
NON_FINITE = "non-finite loss"


class TrainingHalted(RuntimeError):
    """A run stopped on purpose by a reliability policy; the message says why and what to do.

    The trainer fires ``on_halt`` before re-raising it: there the checkpoint hook writes the state
    at the stop (:attr:`crash_path`, for inspection) and names the checkpoint a rerun resumes from
    (:attr:`resume_from`); both join the message.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.crash_path: str | None = None
        self.resume_from: str | None = None
        #: Set once the checkpoint hook has looked (so the message says "no checkpoint" only then).
        self.checked_checkpoints = False

    def __str__(self) -> str:
        parts = [self.message]
        if self.crash_path:
            parts.append(f"The state at the stop is in {self.crash_path} (for inspection; it is never resumed from).")
        if self.resume_from:
            parts.append(f"Running the same command resumes from the last good checkpoint, {self.resume_from}.")
        elif self.checked_checkpoints:
            parts.append("No checkpoint was written before the stop: a rerun starts from the beginning.")
        return " ".join(parts)


class NonFiniteLossError(TrainingHalted):
    """The loss became NaN or infinite (policy ``halt``, or too many skipped steps in a row)."""


class OutOfMemoryHalt(TrainingHalted):
    """Out of memory in a train step (policy ``halt``, or too many skipped steps in a row)."""


class GuardedTask(Protocol):
    """What the guard reads of the task (:class:`sslkit.task.SSLTask` has it; the guard does not import it)."""

    train: bool
    world_size: int
    base_model: nn.Module
    loss: nn.Module
    optimizer: torch.optim.Optimizer


class UpdateGuard:
    """Owns the fate of each update: the stages report, the guard decides, the trainer acts.

    Reports (no decision is taken where they happen):

    * :meth:`report_loss`: the reduce stage passes every train micro-batch's all-reduced loss;
      whether it is finite is recorded on the device (no host sync), with the step, the loss
      terms and the sample indices of the first bad one;
    * :meth:`report_oom`: the micro-batch runner passes an out-of-memory error of a forward or
      backward;
    * :meth:`veto`: a hook (usually in ``on_backward``) drops this update, giving a reason.

    Decisions:

    * :meth:`out_of_memory`, called on every rank after the step's backward passes: under
      ``oom="skip"`` the ranks agree (one all-reduce of a flag) whether any ran out of memory, so
      all drop the same step;
    * :meth:`decide`, called by the update stage before the optimizer step, returns the reason to
      drop this update or None: out of memory as agreed, a non-finite loss under
      ``nonfinite="skip"`` is read here (one host sync per step, the price of that policy; the
      loss is the all-reduced one, so every rank sees the same). A dropped update discards the
      gradients and restores the buffers the forward changed (BatchNorm statistics, queues); it
      still moves the clock. After ``max_consecutive_skips`` in a row the guard halts.
    * :meth:`check` (policy ``nonfinite="halt"``): if any step so far had a non-finite loss, halt.
      Run at every ``check_every`` updates (the log interval, where logging syncs anyway), at the
      end of each train phase and before every checkpoint, so a checkpoint never holds a state
      past a bad step.

    Halting raises :class:`TrainingHalted` (or a subclass); the trainer fires ``on_halt``, where
    the checkpoint hook writes the crash state, and re-raises. Counts of dropped updates are part
    of the checkpoint (:meth:`state_dict`).
    """

    def __init__(self, oom: str = "halt", nonfinite: str = "halt", max_consecutive_skips: int = 10,
                 check_every: int = 50) -> None:
        for key, value in (("reliability.oom", oom), ("reliability.nonfinite_loss", nonfinite)):
            if value not in ("halt", "skip"):
                raise ValueError(f"{key} must be 'halt' or 'skip', got {value!r}")
        self.oom = oom
        self.nonfinite = nonfinite
        self.max_consecutive_skips = max(1, max_consecutive_skips)
        self.check_every = max(1, check_every)
        #: Dropped updates by reason, and how many of the latest updates in a row were dropped.
        self.skipped: dict[str, int] = {}
        self.consecutive = 0
        self._veto: str | None = None
        self._oom = False
        self._snapshot: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._bad: torch.Tensor | None = None  # any bad loss seen (halt) / in this step (skip)
        self._step: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._indices: torch.Tensor | None = None
        self._names: list[str] = []

    @property
    def snapshots(self) -> bool:
        """True when a policy may drop an update: the buffers are then copied before each train step."""
        return self.oom == "skip" or self.nonfinite == "skip"

    # --------------------------------------------------------------------------------- reports
    def begin_step(self, task: GuardedTask) -> None:
        """A train step starts: forget the last one's reports; copy the buffers when an update may be dropped."""
        self._veto = None
        self._oom = False
        self._snapshot = None
        if self.snapshots:
            self._snapshot = [(b, b.detach().clone()) for m in (task.base_model, task.loss) for b in m.buffers()]

    def veto(self, reason: str) -> None:
        """Drop this step's update (a hook's decision, e.g. in ``on_backward``); ``reason`` is counted and logged."""
        self._veto = reason

    def report_oom(self, task: GuardedTask, exc: BaseException) -> None:
        """An out-of-memory error in a forward or backward: halt now (policy ``halt``, or an eval phase), else
        remember it for :meth:`decide`."""
        if not task.train or self.oom != "skip":
            raise OutOfMemoryHalt(
                f"step {task.clock.step + 1}: out of memory in the forward or backward pass ({exc}). "
                "Lower data.batch_size (optim.micro_batches keeps the global batch), enable amp, or "
                "set reliability.oom=skip to drop such steps."
            ) from exc
        self._oom = True

    def report_loss(self, task: GuardedTask, reduced: torch.Tensor, metrics: dict[str, torch.Tensor],
                    sample: dict[str, Any]) -> None:
        """Record on the device whether this train micro-batch's all-reduced loss is finite (no host sync)."""
        bad = ~torch.isfinite(reduced)
        if self._bad is None:
            self._bad = torch.zeros((), dtype=torch.bool, device=bad.device)
        first = bad & ~self._bad
        names = ["loss", *sorted(metrics)]
        values = torch.stack([reduced.float(), *[metrics[n].float().mean() for n in names[1:]]])
        if self._values is None or self._values.shape != values.shape:
            self._names, self._values = names, values.clone()
            self._step = torch.full((), -1, dtype=torch.int64, device=bad.device)
        self._values = torch.where(first, values, self._values)
        self._step = torch.where(first, task.clock.step + 1, self._step)
        indices = sample.get("data_idx")
        if isinstance(indices, torch.Tensor):
            indices = indices.to(bad.device)
            if self._indices is None or self._indices.shape != indices.shape:
                self._indices = indices.clone()
            self._indices = torch.where(first, indices, self._indices)
        self._bad = self._bad | bad

    # ------------------------------------------------------------------------------- decisions
    def out_of_memory(self, task: GuardedTask) -> bool:
        """After the step's backward passes, on every rank: did any rank run out of memory? Under ``oom=skip``
        with several processes the ranks agree here (one all-reduce of a flag), before any gradient reduction,
        so that all of them drop the same step and none waits in a collective the others skip."""
        if self.oom == "skip" and task.world_size > 1:
            (self._oom,) = agree_any(self._oom)
        return self._oom

    def decide(self, task: GuardedTask) -> str | None:
        """Before the optimizer step: the reason to drop this update, or None to apply it."""
        if self._oom:
            return OUT_OF_MEMORY
        if self.nonfinite == "skip" and self._bad is not None:
            bad = bool(self._bad)  # the one host sync per step of this policy
            if bad:
                logger.warning("%s; dropping the update", self._describe())
            self._reset()
            if bad:
                return NON_FINITE
        return self._veto

    def drop(self, task: GuardedTask, reason: str) -> None:
        """Drop this update: discard the gradients, restore the buffers, count it; halt after too many in a row."""
        task.optimizer.zero_grad(set_to_none=True)
        if self._snapshot is not None:
            with torch.no_grad():
                for buffer, copy in self._snapshot:
                    buffer.copy_(copy)
        self._snapshot = None
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.consecutive += 1
        logger.warning("step %d: update dropped (%s); %d dropped so far for this reason, %d in a row",
                       task.clock.step + 1, reason, self.skipped[reason], self.consecutive)
        if self.consecutive >= self.max_consecutive_skips:
            error = OutOfMemoryHalt if reason == OUT_OF_MEMORY else NonFiniteLossError
            raise error(f"step {task.clock.step + 1}: {self.consecutive} updates in a row were dropped ({reason}), "
                        f"reliability.max_consecutive_skips={self.max_consecutive_skips}. The run is not "
                        "recovering: lower optim.lr or data.batch_size, or check the data.")

    def applied(self) -> None:
        """The update went through: the run of dropped updates ends."""
        self.consecutive = 0
        self._snapshot = None

    def due(self, task: GuardedTask) -> bool:
        """True after an update at the check interval (policy ``halt`` reads its flag then)."""
        return task.clock.step % self.check_every == 0

    def check(self, task: GuardedTask) -> None:
        """Policy ``halt``: if any train step so far had a non-finite loss, raise :class:`NonFiniteLossError`."""
        if self.nonfinite != "halt" or self._bad is None or not bool(self._bad):
            return
        message = self._describe()
        self._reset()
        from sslkit.stability import fp16_temperature_warning

        hint = fp16_temperature_warning(getattr(task, "loss", None), getattr(task, "amp_dtype", None))
        cause = f" A likely cause: {hint}" if hint else ""
        raise NonFiniteLossError(f"{message}. Policy reliability.nonfinite_loss=halt: lower optim.lr, check those "
                                 f"samples, or set reliability.nonfinite_loss=skip.{cause}")

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

    # ------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Dropped updates by reason and the current run of them."""
        return {"skipped_steps": dict(self.skipped), "consecutive_skips": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.skipped = dict(state["skipped_steps"])
        self.consecutive = int(state["consecutive_skips"])
