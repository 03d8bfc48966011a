"""SSLTask: the typed state that the train step and every hook may read and change."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from sslkit.clock import StepContext, TrainClock
from sslkit.data.loader import position_loader
from sslkit.events import Event, Hook, in_order
from sslkit.guard import UpdateGuard
from sslkit.optim.schedules import ClockSchedule
from sslkit.train_steps.sample import phase_samples
from sslkit.train_steps.timing import PerfStats

__all__ = ["DataPlan", "MicroBatch", "Phase", "RunInfo", "SSLTask", "Training"]

logger = logging.getLogger("sslkit")


@dataclass
class Phase:
    """One pass over a split: a train epoch, or an eval pass (no grad, no update)."""

    train: bool
    #: The train epoch this phase belongs to (eval phases carry the epoch they follow).
    epoch: int
    split: str = "train"


@dataclass
class MicroBatch:
    """One micro-batch's data as the step's stages pass it on: made by ``forward_and_loss``, taken by ``reduce``,
    ``backward`` and ``update``; the latest is also ``task.last_batch``, what hooks read."""

    #: The sample dict: ``input`` (list of view tensors), ``target``, ``data_valid``, ``data_idx``.
    sample: dict[str, Any]
    #: The model's output: a :class:`~sslkit.models.output.ModelOutput` for sslkit's models (``features``,
    #: ``projections``, ... one tensor per view).
    model_output: Any = None
    #: This rank's loss, attached to the graph.
    loss: torch.Tensor | None = None
    #: The loss averaged over ranks, detached (what is logged).
    reduced_loss: torch.Tensor | None = None
    #: Named scalars logged at the log interval (detached, on device): the loss terms a loss
    #: returns next to ``loss``, and what monitor hooks add (e.g. ``embedding_std``).
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    #: True once the gradients were divided by the GradScaler's scale (``stages.unscale_gradients``).
    unscaled: bool = False


@dataclass
class Training:
    """The model and how it is optimised: fields the builder hands to :class:`SSLTask` (each becomes the task's)."""

    #: The model that is trained (wrapped in DDP in distributed runs).
    model: nn.Module
    #: The loss module; its buffers (queues, centres) are checkpointed.
    loss: nn.Module
    #: The optimizer; the update stage sets each group's lr from ``lr_schedule.at(clock)``.
    optimizer: torch.optim.Optimizer
    #: Learning rate on the training clock.
    lr_schedule: ClockSchedule
    #: Weight decay on the training clock (None keeps the optimizer's).
    wd_schedule: ClockSchedule | None = None
    #: GradScaler for float16 AMP, else None.
    scaler: torch.amp.GradScaler | None = None
    #: autocast dtype (bfloat16 / float16), or None when AMP is off: the precision policy.
    amp_dtype: torch.dtype | None = None
    #: Micro-batches per optimizer update (gradient accumulation) in train phases.
    micro_batches: int = 1
    #: Samples per optimizer update over all ranks.
    global_batch_size: int = 1
    #: Backward under ``no_sync`` and an explicit bucketed all-reduce of the gradients.
    manual_gradient_reduction: bool = False
    #: Bucket size of the manual gradient reduction.
    bucket_cap_mb: float = 25.0
    #: Inputs are converted to channels_last memory format.
    channels_last: bool = False
    #: Clip the gradients to this norm before each optimizer update (0: off); the pre-clip norm is logged.
    clip_grad: float = 0.0
    #: ``global`` (one norm over every parameter) or ``per_parameter`` (each gradient on its own, as DINO).
    clip_grad_mode: str = "global"

    def __post_init__(self) -> None:
        self.micro_batches = max(1, self.micro_batches)


@dataclass
class DataPlan:
    """What the run reads and in which order (the data position, ``phase_idx`` and the clock's step, lives on
    the task)."""

    #: DataLoaders by split; their samplers are :class:`StatefulDistributedSampler`.
    loaders: dict[str, torch.utils.data.DataLoader]
    #: The phases of the run, in order.
    phases: list[Phase]
    #: ``data.augment_on=device``: augments each train batch on the device (the loaders then give the images as
    #: read); None when the loader workers augment.
    device_augment: Any = None
    #: ``data.decode_on=device``: decodes the JPEG bytes of a train batch on the device before that
    #: (:class:`~sslkit.data.device_decode.DeviceDecoder`); None when the workers decode.
    device_decoder: Any = None
    #: ``masking``: draws each train batch's masks on the device (:class:`~sslkit.models.masking.MaskPlan`), handed to
    #: the model as ``model(views, masks=sample["masks"])``; None for methods without masks.
    masking: Any = None


@dataclass
class RunInfo:
    """Where and as what this process runs."""

    #: Device of the model and the samples.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: This process's rank and the number of processes.
    rank: int = 0
    world_size: int = 1
    #: The run's seed.
    seed: int = 0
    #: Where logs, metrics and checkpoints go.
    output_dir: str = "."
    #: The resolved config (read-only; for logging and checkpoint metadata).
    config: Any = None
    #: The resolved config as YAML text, made once by the builder: what every checkpoint stores (None without one).
    config_text: str | None = None


class SSLTask:
    """Everything a step and a hook may touch, built by :func:`sslkit.builder.build_task`: plain state, one name
    per field, each an attribute of the task.

    The builder hands it over in groups, whose fields become the task's: :class:`Training` (``model``, ``loss``,
    ``optimizer``, the schedules, precision, accumulation, clipping), :class:`DataPlan` (``loaders``, ``phases``
    and the device-side data parts) and :class:`RunInfo` (``device``, ``rank``, ``world_size``, ``seed``,
    ``output_dir``, ``config``). Beside them: the ``clock`` (:class:`~sslkit.clock.TrainClock`: epoch, step in
    epoch, optimizer update, micro-batch), the ``hooks``, whose states (with the loss's buffers) are the method
    state a checkpoint holds, and the ``guard`` (:class:`~sslkit.guard.UpdateGuard`: the fate of updates that ran
    out of memory or are not finite). The clock and ``phase_idx`` are the resume position. How the state is saved
    and restored is the checkpointer's (:mod:`sslkit.checkpointing.state`).
    """

    # Training
    model: nn.Module
    loss: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: ClockSchedule
    wd_schedule: ClockSchedule | None
    scaler: torch.amp.GradScaler | None
    amp_dtype: torch.dtype | None
    micro_batches: int
    global_batch_size: int
    manual_gradient_reduction: bool
    bucket_cap_mb: float
    channels_last: bool
    clip_grad: float
    clip_grad_mode: str
    # DataPlan
    loaders: dict[str, torch.utils.data.DataLoader]
    phases: list[Phase]
    device_augment: Any
    device_decoder: Any
    masking: Any
    # RunInfo
    device: torch.device
    rank: int
    world_size: int
    seed: int
    output_dir: str
    config: Any
    config_text: str | None

    def __init__(self, training: Training, data: DataPlan, hooks: list[Hook], *, run: RunInfo | None = None,
                 max_steps: int = 1, guard: UpdateGuard | None = None) -> None:
        for group in (training, data, run or RunInfo()):
            for f in fields(group):
                setattr(self, f.name, getattr(group, f.name))
        #: Hooks in the order they run: by slot (:class:`~sslkit.events.Slot`), then as given.
        self.hooks = in_order(hooks)
        #: The run's one clock (epoch, step in epoch, optimizer update, micro-batch): what schedules read.
        self.clock = TrainClock(max_steps=max(1, max_steps), micro_batches=self.micro_batches)
        #: The value of every schedule at the latest update, by name (``lr``, ``weight_decay``,
        #: ``teacher_momentum``, ...): written by whoever computes it, logged at the log interval.
        self.scheduled: dict[str, float] = {}

        #: Index into ``phases`` of the current phase.
        self.phase_idx = 0
        #: True once the current phase has run out of data (set before ``on_phase_end``).
        self.phase_done = False
        #: The current phase's samples (:func:`~sslkit.train_steps.sample.phase_samples`, opened by
        #: :meth:`start_phase`): prepared on the device, a train phase's one ahead.
        self.data_iterator: Iterator[dict[str, Any]] = iter(())
        #: The latest micro-batch's sample, output, loss and logged metrics (:class:`MicroBatch`), published by the
        #: forward stage for the hooks; the stages pass it to each other, they never read it back from here.
        self.last_batch: MicroBatch | None = None
        #: Sum of reduced losses since the last log and their count, on device (no sync).
        self.loss_sum = torch.zeros((), device=self.device)
        self.loss_count = 0
        #: Step-section timers.
        self.perf_stats = PerfStats(self.device)
        #: The exception being handled during ``on_exception``.
        self.exception: BaseException | None = None

        #: Set (to the signal's name) by the pre-emption hook when the run must stop after this step; the
        #: checkpoint hook then writes a checkpoint (its path in ``stop_checkpoint``) and the trainer stops.
        self.stop_requested: str | None = None
        self.stop_checkpoint: str | None = None
        #: Decides the fate of an update that ran out of memory or is not finite (docs/reliability.md).
        self.guard = guard or UpdateGuard()

    # -------------------------------------------------------------------------------- clock
    def context(self) -> StepContext:
        """The step context handed to the loss: the clock, the phase, the device, the precision."""
        return StepContext(clock=self.clock, train=self.train, device=self.device, amp_dtype=self.amp_dtype,
                           world_size=self.world_size, scheduled=self.scheduled)

    # ----------------------------------------------------------------------------- position
    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self.phases[min(self.phase_idx, len(self.phases) - 1)]

    @property
    def train(self) -> bool:
        """True in train phases."""
        return self.phase.train

    @property
    def epoch(self) -> int:
        """The current train epoch (0-based)."""
        return self.phase.epoch

    @property
    def done_training(self) -> bool:
        """True when every phase has run."""
        return self.phase_idx >= len(self.phases)

    @property
    def out_of_steps(self) -> bool:
        """True in a train phase once ``clock.max_steps`` optimizer steps are done."""
        return self.phase.train and self.clock.step >= self.clock.max_steps

    @property
    def batches_per_step(self) -> int:
        """Loader batches one step consumes: ``micro_batches`` in train phases, else 1."""
        return self.micro_batches if self.train else 1

    @property
    def base_model(self) -> nn.Module:
        """The model without its DDP wrapper."""
        return getattr(self.model, "module", self.model)

    @property
    def steps_per_phase(self) -> int | None:
        """Steps the current phase's loader gives over the whole phase (None for a loader without a length),
        counting those before a resume position (a sampler's length is what is left from its start)."""
        loader = self.loader
        try:
            batches = len(loader)
        except TypeError:
            return None
        if loader.batch_size:
            batches += getattr(loader.sampler, "start", 0) // loader.batch_size
        return batches // self.batches_per_step

    @property
    def loader(self) -> torch.utils.data.DataLoader:
        """The loader of the current phase's split."""
        return self.loaders[self.phase.split]

    # ------------------------------------------------------------------------------- hooks
    def run_hooks(self, event: Event) -> None:
        """Call ``event`` on every hook, in slot order."""
        name = event.value
        for hook in self.hooks:
            getattr(hook, name)(self)

    # ------------------------------------------------------------------------------ phases
    def start_phase(self) -> None:
        """Position the current phase's loader (its seeds, epoch and resume offset: :func:`position_loader`) and
        open its samples (:func:`~sslkit.train_steps.sample.phase_samples`: a train phase's prefetched)."""
        per_step = self.batches_per_step
        position_loader(self.loader, self.seed, self.epoch, start_batch=self.clock.step_in_epoch * per_step,
                        update=self.clock.step if self.train else None, batches_per_update=per_step)
        self.phase_done = False
        self.clock.epoch = self.epoch
        self.clock.micro_batch = 0
        self.clock.micro_batches = self.batches_per_step
        self.data_iterator = phase_samples(self, iter(self.loader), self.clock.step_in_epoch * per_step)

    def end_phase(self, exhausted: bool = True) -> None:
        """End the phase. It is done (a checkpoint points past it) when its data ran out; a train phase cut
        short by ``clock.max_steps`` is not: a checkpoint keeps its position inside it, so a run lengthened
        later (a larger ``optim.max_steps``) goes on from that very step."""
        per_phase = self.steps_per_phase
        self.phase_done = exhausted or (per_phase is not None and self.clock.step_in_epoch >= per_phase)

    def close(self) -> None:
        """Stop the loaders' worker processes now (persistent workers otherwise live until garbage
        collection, which an exception's reference cycle can put off past interpreter exit) and drop
        the exception being handled."""
        self.data_iterator = iter(())
        for loader in self.loaders.values():
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
                loader._iterator = None
        self.exception = None

    def advance_phase(self, to: int | None = None) -> None:
        """Move to the next phase (after ``on_phase_end``), or to phase ``to``."""
        self.phase_idx = self.phase_idx + 1 if to is None else to
        self.clock.step_in_epoch = 0
        self.phase_done = False
        self.data_iterator = iter(())
