"""SSLTask: the typed state that the train step and every hook may read and change."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sslkit.clock import StepContext, TrainClock
from sslkit.data.seeding import mix_seed
from sslkit.events import Event, Hook, in_order
from sslkit.guard import UpdateGuard
from sslkit.optim.schedules import ClockSchedule

__all__ = ["DataPlan", "LastBatch", "PerfStats", "Phase", "RunInfo", "SSLTask", "Training"]

logger = logging.getLogger("sslkit")


@dataclass
class Phase:
    """One pass over a split: a train epoch, or an eval pass (no grad, no update)."""

    train: bool
    #: The train epoch this phase belongs to (eval phases carry the epoch they follow).
    epoch: int
    split: str = "train"


@dataclass
class LastBatch:
    """What the current step has produced so far; hooks read it, the step fills it in."""

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


class PerfStats:
    """Timers per step section, true on a GPU without syncing the step.

    On the CPU a section's time is the host's wall-clock time in it. On CUDA, where kernels run
    after the host has queued them, host time would be charged to whichever section happens to
    wait (the first sync), so each section records a pair of CUDA events on the current stream
    instead: its time is the GPU's time between them, which holds the kernels the section
    queued and, for ``read_sample``, the time the GPU sat idle waiting for data. The events are
    read only when asked (:meth:`resolve`: by :meth:`table` at phase end and by the log hook at
    its interval, where it syncs anyway), never inside a step.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._pending: list[tuple[str, Any, Any]] = []  # (section, start event, end event) not read yet
        self._free: list[Any] = []  # events read already, for reuse

    def _event(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to section ``name``."""
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.cuda:
            start = self._event()
            try:
                yield
            finally:
                self._pending.append((name, start, self._event()))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - begin

    def resolve(self) -> None:
        """Read the CUDA events recorded so far into :attr:`totals` (waits for the last one: a sync)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for name, start, end in self._pending:
            self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._free += (start, end)
        self._pending.clear()

    def reset(self) -> None:
        """Forget all timings (called at phase start)."""
        self._free += [e for _, start, end in self._pending for e in (start, end)]
        self._pending.clear()
        self.totals.clear()
        self.counts.clear()

    def table(self) -> str:
        """A text table: section, calls, total seconds, mean milliseconds, share of the total."""
        self.resolve()
        total = sum(self.totals.values()) or 1.0
        clock = "GPU time per section (CUDA events)" if self.cuda else "host time per section"
        lines = [clock, f"{'section':<18}{'calls':>8}{'total s':>10}{'mean ms':>10}{'share':>8}"]
        for name, secs in self.totals.items():
            n = self.counts[name]
            lines.append(f"{name:<18}{n:>8}{secs:>10.2f}{1000 * secs / n:>10.2f}{secs / total:>8.1%}")
        return "\n".join(lines)


@dataclass
class Training:
    """The model and how it is optimised (one group of :class:`SSLTask`'s state)."""

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
    accumulate_steps: int = 1
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
        self.accumulate_steps = max(1, self.accumulate_steps)


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
    _text: tuple[int, str | None] | None = field(default=None, init=False, repr=False, compare=False)

    def config_text(self) -> str | None:
        """The resolved config as YAML text (None when the task was built without one): made once per config
        object, which a run never changes, rather than at every checkpoint."""
        if self._text is None or self._text[0] != id(self.config):
            self._text = (id(self.config), _config_text(self.config))
        return self._text[1]


class _Alias:
    """``task.<name>`` reads and writes ``task.<group>.<field>`` (``field`` defaults to ``name``): the flat names
    hooks use, over grouped state."""

    def __init__(self, group: str, field: str | None = None) -> None:
        self.group = group
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.field or name
        self.__doc__ = f"``{self.group}.{self.name}``."

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.group), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.group), self.name, value)


class SSLTask:
    """Everything a step and a hook may touch, built by :func:`sslkit.builder.build_task`, in groups:

    * ``training`` (:class:`Training`): model, loss, optimizer, schedules, precision, accumulation;
    * ``data`` (:class:`DataPlan`): loaders and phases; with ``phase_idx`` and ``data_iterator``, the
      data position;
    * ``clock`` (:class:`~sslkit.clock.TrainClock`): epoch, step in epoch, optimizer update, micro-batch;
    * ``hooks``: the method's hooks and the others, whose states (with the loss's buffers) are the
      method state a checkpoint holds;
    * ``run`` (:class:`RunInfo`): device, rank, world size, seed, output folder, config;
    * ``guard`` (:class:`~sslkit.guard.UpdateGuard`): the fate of updates that ran out of memory or
      are not finite.

    Every field of the groups is also an attribute of the task (``task.model`` is
    ``task.training.model``). The clock and the phase index are the resume position: a checkpoint
    stores them, and a resumed run continues from the same phase and step with the same samples.
    """

    model = _Alias("training")
    loss = _Alias("training")
    optimizer = _Alias("training")
    lr_schedule = _Alias("training")
    wd_schedule = _Alias("training")
    scaler = _Alias("training")
    amp_dtype = _Alias("training")
    accumulate_steps = _Alias("training")
    global_batch_size = _Alias("training")
    manual_gradient_reduction = _Alias("training")
    bucket_cap_mb = _Alias("training")
    channels_last = _Alias("training")
    loaders = _Alias("data")
    phases = _Alias("data")
    device = _Alias("run")
    rank = _Alias("run")
    world_size = _Alias("run")
    seed = _Alias("run")
    output_dir = _Alias("run")
    config = _Alias("run")

    def __init__(self, training: Training, data: DataPlan, hooks: list[Hook], *, run: RunInfo | None = None,
                 max_updates: int = 1, guard: UpdateGuard | None = None) -> None:
        self.training = training
        self.data = data
        self.run = run or RunInfo()
        #: Hooks in the order they run: by slot (:class:`~sslkit.events.Slot`), then as given.
        self.hooks = in_order(hooks)
        #: The run's one clock (epoch, step in epoch, optimizer update, micro-batch): what schedules read.
        self.clock = TrainClock(max_updates=max(1, max_updates), micro_batches=training.accumulate_steps)
        #: The value of every schedule at the latest update, by name (``lr``, ``weight_decay``,
        #: ``teacher_momentum``, ...): written by whoever computes it, logged at the log interval.
        self.scheduled: dict[str, float] = {}

        #: Index into ``phases`` of the current phase.
        self.phase_idx = 0
        #: True once the current phase has run out of data (set before ``on_phase_end``).
        self.phase_done = False
        #: The iterator over the current phase's loader.
        self.data_iterator: Iterator[dict[str, Any]] = iter(())
        #: The current step's sample, output and loss.
        self.last_batch: LastBatch | None = None
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
    def where(self) -> float:
        """Progress of training in [0, 1): ``clock.where``, the argument of the lr, wd and momentum schedules."""
        return self.clock.where

    @property
    def done_training(self) -> bool:
        """True when every phase has run."""
        return self.phase_idx >= len(self.phases)

    @property
    def out_of_steps(self) -> bool:
        """True in a train phase once ``clock.max_updates`` optimizer steps are done."""
        return self.phase.train and self.clock.update >= self.clock.max_updates

    @property
    def batches_per_step(self) -> int:
        """Loader batches one step consumes: ``accumulate_steps`` in train phases, else 1."""
        return self.accumulate_steps if self.train else 1

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
        """Position the current phase's sampler (epoch, resume offset) and open its iterator."""
        loader = self.loader
        sampler = loader.sampler
        # DataLoader draws its workers' base seed from this generator at every iter(); without
        # its own, that draw would consume the global torch RNG and a resumed run would diverge.
        if loader.generator is None:
            loader.generator = torch.Generator()
        loader.generator.manual_seed(mix_seed(self.seed, self.epoch))
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        if hasattr(sampler, "set_start"):
            sampler.set_start(self.clock.step_in_epoch * self.batches_per_step * loader.batch_size)
        if self.train and getattr(sampler, "track_updates", False):
            sampler.updates_from(self.clock.update, self.batches_per_step * loader.batch_size)
        self.phase_done = False
        self.clock.epoch = self.epoch
        self.clock.micro_batch = 0
        self.clock.micro_batches = self.batches_per_step
        self.data_iterator = iter(loader)

    def end_phase(self, exhausted: bool = True) -> None:
        """End the phase. It is done (a checkpoint points past it) when its data ran out; a train phase cut
        short by ``clock.max_updates`` is not: a checkpoint keeps its position inside it, so a run lengthened
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


def _config_text(config: Any) -> str | None:
    """The resolved config as YAML text (None when the task was built without one)."""
    if config is None:
        return None
    from omegaconf import DictConfig

    from sslkit.config.text import config_yaml

    return config_yaml(config) if isinstance(config, DictConfig) else None
