"""Every per-update value of a run (learning rate, weight decay, teacher momentum, teacher temperatures) as a
:class:`ClockSchedule` read off the training clock, and the lr scaling rules."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

from fvcore.common.param_scheduler import (
    CompositeParamScheduler,
    ConstantParamScheduler,
    CosineParamScheduler,
    LinearParamScheduler,
    ParamScheduler,
)

from sslkit.clock import TrainClock
from sslkit.errors import did_you_mean

__all__ = ["SCALING_RULES", "SCHEDULE_NAMES", "ClockSchedule", "OnProgress", "TeacherMomentum",
           "TeacherTemperature", "WarmupCosine", "build_schedule", "momentum_at", "scaled_lr", "teacher_temp_at"]

SCHEDULE_NAMES: tuple[str, ...] = ("constant", "cosine", "linear")
SCALING_RULES: tuple[str, ...] = ("linear", "none", "sqrt")


class ClockSchedule(ABC):
    """A value that changes with every optimizer update, read off the run's :class:`~sslkit.clock.TrainClock` with
    :meth:`at`: the one way every schedule is asked (the update stage for the lr and weight decay, the momentum
    hook for the teacher momentum, the DINO-family losses for their teacher temperatures), so each is written once
    here, in the clock's unit its paper uses: progress ``clock.where`` or updates ``clock.step``."""

    @abstractmethod
    def at(self, clock: TrainClock) -> float:
        """The value at the clock's current update."""


class OnProgress(ClockSchedule):
    """A schedule of the run's progress ``clock.where`` in [0, 1) (an fvcore ``ParamScheduler``, or any function of
    progress): the learning rate, the weight decay and the teacher momentum."""

    def __init__(self, schedule: Callable[[float], float]) -> None:
        self.schedule = schedule

    def at(self, clock: TrainClock) -> float:
        """``schedule(clock.where)``."""
        return self.schedule(clock.where)


def _unknown(kind: str, name: str, valid: tuple[str, ...]) -> ValueError:
    return ValueError(f"unknown {kind} '{name}'.{did_you_mean(name, valid)} Valid: {', '.join(valid)}.")


def build_schedule(
    name: str,
    base_value: float,
    final_value: float = 0.0,
    warmup_fraction: float = 0.0,
    warmup_start_value: float = 0.0,
) -> ParamScheduler:
    """Build a schedule: a callable mapping training progress ``where`` in [0, 1) to a value.

    Over ``[0, warmup_fraction)`` the value rises linearly from ``warmup_start_value`` to
    ``base_value``; over ``[warmup_fraction, 1)`` it follows ``name``:

    * ``"cosine"``: half-cosine from ``base_value`` down (or up) to ``final_value``,
      ``final + (base - final) * (1 + cos(pi * t)) / 2``;
    * ``"linear"``: straight line from ``base_value`` to ``final_value``;
    * ``"constant"``: ``base_value`` (``final_value`` is ignored).

    ``t`` is the progress within the post-warmup part, rescaled to [0, 1) (fvcore
    ``CompositeParamScheduler`` with ``interval_scaling="rescaled"``), so the value at
    ``where == warmup_fraction`` is exactly ``base_value`` and ``final_value`` is reached as
    ``where`` approaches 1. With ``warmup_fraction == 0`` the bare post-warmup schedule is returned.

    Raises:
        ValueError: ``name`` is not one of :data:`SCHEDULE_NAMES` (the message names the closest),
            or ``warmup_fraction`` is outside [0, 1).
    """
    if name not in SCHEDULE_NAMES:
        raise _unknown("schedule", name, SCHEDULE_NAMES)
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")

    main: ParamScheduler
    if name == "cosine":
        main = CosineParamScheduler(start_value=base_value, end_value=final_value)
    elif name == "linear":
        main = LinearParamScheduler(start_value=base_value, end_value=final_value)
    else:
        main = ConstantParamScheduler(value=base_value)

    if warmup_fraction == 0.0:
        return main
    warmup = LinearParamScheduler(start_value=warmup_start_value, end_value=base_value)
    return CompositeParamScheduler(
        schedulers=[warmup, main],
        lengths=[warmup_fraction, 1.0 - warmup_fraction],
        interval_scaling=["rescaled", "rescaled"],
    )


def scaled_lr(
    base_lr: float, global_batch_size: int, rule: str = "linear", reference_batch_size: int = 256
) -> float:
    """Scale a learning rate given for ``reference_batch_size`` (256) to ``global_batch_size`` ``B``.

    * ``"linear"``: ``base_lr * B / 256`` (Goyal et al., 2017; MoCo, BYOL, Barlow Twins);
    * ``"sqrt"``: ``base_lr * sqrt(B / 256)``. SimCLR's LARS recipe ``lr = 0.075 * sqrt(B)``
      is this rule with ``base_lr = 0.075 * 16 = 1.2``;
    * ``"none"``: ``base_lr`` unchanged.

    Raises:
        ValueError: unknown ``rule`` or a non-positive batch size.
    """
    if rule not in SCALING_RULES:
        raise _unknown("lr scaling rule", rule, SCALING_RULES)
    if global_batch_size <= 0 or reference_batch_size <= 0:
        raise ValueError(
            f"batch sizes must be positive, got global_batch_size={global_batch_size}, "
            f"reference_batch_size={reference_batch_size}"
        )
    ratio = global_batch_size / reference_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def teacher_temp_at(step: int, warmup_teacher_temp: float, teacher_temp: float, warmup_steps: int) -> float:
    """Teacher temperature at optimizer update ``step`` (0-based): linear from ``warmup_teacher_temp``
    to ``teacher_temp`` over ``warmup_steps`` updates, then constant (DINO, appendix: 0.04 ->
    0.07 over the first 30 epochs; the reference moves once per epoch, this once per update)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return float(teacher_temp)
    return float(warmup_teacher_temp + (teacher_temp - warmup_teacher_temp) * step / warmup_steps)


class TeacherTemperature(ClockSchedule):
    """A teacher temperature on the training clock's updates: :func:`teacher_temp_at` from ``warmup`` to ``final``
    over ``warmup_steps`` optimizer updates, or ``warmup_epochs`` epochs (the papers' unit: DINO's and DINOv2's
    30), which :meth:`set_epoch_length` turns into updates once the run's length is known."""

    def __init__(self, final: float, warmup: float, warmup_steps: int = 0, warmup_epochs: float = 0.0) -> None:
        if warmup_steps > 0 and warmup_epochs > 0:
            raise ValueError("give the teacher temperature warm-up in updates (loss.warmup_teacher_temp_steps) or in "
                             "epochs (loss.warmup_teacher_temp_epochs), not both")
        self.final, self.warmup = float(final), float(warmup)
        self.warmup_steps, self.warmup_epochs = int(warmup_steps), float(warmup_epochs)

    def set_epoch_length(self, updates: int) -> None:
        """The run's optimizer updates per epoch: a warm-up given in epochs becomes updates."""
        if self.warmup_epochs > 0:
            self.warmup_steps = max(1, round(self.warmup_epochs * updates))

    def at(self, clock: TrainClock) -> float:
        """The temperature at the clock's optimizer update ``clock.step``."""
        return teacher_temp_at(clock.step, self.warmup, self.final, self.warmup_steps)


def momentum_at(where: float, base: float, final: float = 1.0, schedule: str = "cosine") -> float:
    """The teacher momentum at progress ``where`` in [0, 1), written as the papers write it (the arithmetic of
    fvcore's curves differs in the last bits, and the teachers carry such bits on).

    ``cosine``: ``final - (final - base) * (cos(pi * where) + 1) / 2`` (BYOL, DINO): ``base`` at
    the start, ``final`` at the end. ``linear``: ``base + (final - base) * where`` (I-JEPA).
    ``constant``: ``base`` throughout (MoCo v2).
    """
    if schedule == "constant":
        return base
    if schedule == "linear":
        return base + (final - base) * where
    if schedule == "cosine":
        return final - (final - base) * (math.cos(math.pi * where) + 1) / 2
    raise ValueError(f"unknown momentum schedule '{schedule}': use cosine, linear or constant")


class TeacherMomentum(ClockSchedule):
    """The EMA teacher's momentum on the run's progress ``clock.where``: :func:`momentum_at` from ``base`` to
    ``final``."""

    def __init__(self, base: float, final: float = 1.0, schedule: str = "cosine") -> None:
        momentum_at(0.0, base, final, schedule)  # an unknown name is refused here, when the hook is built
        self.base, self.final, self.name = float(base), float(final), schedule

    def at(self, clock: TrainClock) -> float:
        """The momentum at ``clock.where``."""
        return momentum_at(clock.where, self.base, self.final, self.name)


class WarmupCosine(ClockSchedule):
    """A value on the training clock's updates, as DINOv3's ``linear_warmup_cosine_decay`` (its Gram loss weight):
    from ``start`` towards ``peak`` over ``warmup_steps`` (linear, ``peak`` itself not reached), a half cosine
    from ``peak`` to ``end`` over ``cosine_steps`` (both ends included), then ``end``; before ``offset`` (the
    update the schedule starts at) ``start``."""

    def __init__(self, start: float, peak: float, end: float, warmup_steps: int, cosine_steps: int,
                 offset: int = 0) -> None:
        if warmup_steps < 0 or cosine_steps < 0:
            raise ValueError(f"warm-up and cosine lengths must be >= 0, got {warmup_steps} and {cosine_steps}")
        self.start, self.peak, self.end = float(start), float(peak), float(end)
        self.warmup_steps, self.cosine_steps, self.offset = int(warmup_steps), int(cosine_steps), int(offset)

    def at(self, clock: TrainClock) -> float:
        """The value at ``clock.step``."""
        i = clock.step - self.offset
        if i < 0:
            return self.start
        if i < self.warmup_steps:
            return self.start + (self.peak - self.start) * i / self.warmup_steps
        j = i - self.warmup_steps
        if j < self.cosine_steps:
            angle = math.pi * j / (self.cosine_steps - 1) if self.cosine_steps > 1 else 0.0
            return (self.peak - self.end) * (math.cos(angle) + 1) / 2 + self.end
        return self.end
