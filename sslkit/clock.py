"""The training clock every schedule reads, and the step context handed to losses and hooks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["StepContext", "TrainClock"]


@dataclass
class TrainClock:
    """Where training stands, in the units schedules are written in. The task owns the one instance.

    Four hands, from slow to fast:

    * ``epoch``: the current train epoch (0-based; an eval phase carries the epoch it follows);
    * ``step_in_epoch``: steps done in the current phase (the resume position inside it);
    * ``step``: optimizer steps (updates) done since the start of the run. Every schedule (learning
      rate, weight decay, teacher momentum, teacher temperature, queue start, frozen layers) runs
      on this hand, through :attr:`where` or directly, so a run with gradient accumulation K and
      batch B/K sees the same value at each update as a run with batch B. An update dropped by
      the update guard (out of memory, non-finite loss) still moves it: the schedules stay on
      time;
    * ``micro_batch``: the micro-batch inside the current step, ``0 .. micro_batches - 1``
      (``optim.micro_batches``; 1 without accumulation, and in eval phases).

    ``samples`` counts the images trained on over all ranks (updates actually applied x global
    batch). Only the task's stages move the hands; losses and hooks read them.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    step: int = 0
    micro_batch: int = 0
    micro_batches: int = 1
    #: Steps the run makes in total (``optim.max_steps``, or epochs x steps per epoch).
    max_steps: int = 1
    #: Images trained on, all ranks together.
    samples: int = 0
    #: The stage of the schedule: ``"base"``, or ``"high_res"`` in a high-resolution phase (``hires.*``, set by
    #: :class:`~sslkit.hooks.resolution.HighResolutionHook`); a checkpoint's ``position.stage``.
    stage: str = "base"

    @property
    def where(self) -> float:
        """Progress in [0, 1): ``step / max_steps``, the argument of the lr, wd and momentum schedules."""
        return min(self.step / max(self.max_steps, 1), 1.0 - 1e-9)

    @property
    def last_micro_batch(self) -> bool:
        """True on the step's last micro-batch: state that moves once per update moves here."""
        return self.micro_batch == self.micro_batches - 1


@dataclass
class StepContext:
    """What a loss and a hook may read in one step: the clock, the phase, the device and precision.

    Scheduled values a loss or hook computes (``teacher_temp``, ``teacher_momentum``) are put in
    :attr:`scheduled` with :meth:`record`; the update stage puts ``lr`` and ``weight_decay``
    there. The log hook writes them into each record of metrics.jsonl, so a user sees every
    schedule per logged update. The dict is the task's own and outlives the step.
    """

    clock: TrainClock
    train: bool
    device: torch.device
    #: autocast dtype, or None when mixed precision is off.
    amp_dtype: torch.dtype | None = None
    world_size: int = 1
    scheduled: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, value: float) -> None:
        """Publish the value of a schedule at this update (a Python number: logging it costs no sync)."""
        self.scheduled[name] = float(value)
