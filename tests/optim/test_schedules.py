"""Tests for sslkit.optim.build_schedule (warmup + cosine / linear / constant) and scaled_lr."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from sslkit.optim import build_schedule, scaled_lr

BASE, FINAL, WARMUP, START = 1.0, 0.1, 0.2, 0.01


def _cosine_closed_form(where: float) -> float:
    if where < WARMUP:
        return START + (BASE - START) * where / WARMUP
    t = (where - WARMUP) / (1.0 - WARMUP)
    return FINAL + 0.5 * (BASE - FINAL) * (1.0 + math.cos(math.pi * t))


def test_cosine_with_warmup_landmarks() -> None:
    s = build_schedule("cosine", BASE, final_value=FINAL, warmup_fraction=WARMUP, warmup_start_value=START)
    assert s(0.0) == pytest.approx(START)
    assert s(WARMUP / 2) == pytest.approx((START + BASE) / 2)
    assert s(WARMUP) == pytest.approx(BASE)
    midpoint = WARMUP + (1.0 - WARMUP) / 2
    assert s(midpoint) == pytest.approx((BASE + FINAL) / 2)
    assert s(1.0 - 1e-9) == pytest.approx(FINAL, abs=1e-6)
    # peak at the end of warmup, monotone decay afterwards
    values = [s(i / 1000) for i in range(1000)]
    peak = values.index(max(values))
    assert peak == int(WARMUP * 1000)
    assert all(a >= b for a, b in pairwise(values[peak:]))
    assert all(a <= b for a, b in pairwise(values[: peak + 1]))


@pytest.mark.parametrize("where", [0.0, 0.05, 0.1, 0.19, 0.2, 0.3, 0.5, 0.6, 0.77, 0.9, 0.999])
def test_cosine_matches_closed_form(where: float) -> None:
    s = build_schedule("cosine", BASE, final_value=FINAL, warmup_fraction=WARMUP, warmup_start_value=START)
    assert s(where) == pytest.approx(_cosine_closed_form(where), abs=1e-6)


def test_cosine_without_warmup() -> None:
    s = build_schedule("cosine", 0.5)
    assert s(0.0) == pytest.approx(0.5)
    assert s(0.5) == pytest.approx(0.25)
    assert s(0.25) == pytest.approx(0.25 * (1 + math.cos(math.pi / 4)))
    assert s(0.999999) == pytest.approx(0.0, abs=1e-9)


def test_cosine_can_increase() -> None:
    # e.g. BYOL's target momentum 0.996 -> 1.0, or DINO's weight decay 0.04 -> 0.4
    s = build_schedule("cosine", 0.04, final_value=0.4)
    assert s(0.0) == pytest.approx(0.04)
    assert s(0.5) == pytest.approx(0.22)
    assert s(0.99) < 0.4 and s(0.99) > s(0.9)


def test_constant_with_warmup() -> None:
    s = build_schedule("constant", 0.3, final_value=123.0, warmup_fraction=0.1)
    assert s(0.0) == pytest.approx(0.0)
    assert s(0.05) == pytest.approx(0.15)
    for where in (0.1, 0.5, 0.99):
        assert s(where) == pytest.approx(0.3)  # final_value is ignored


def test_constant_without_warmup() -> None:
    s = build_schedule("constant", 0.3)
    assert [s(w) for w in (0.0, 0.4, 0.9)] == [0.3, 0.3, 0.3]


def test_linear_with_warmup() -> None:
    s = build_schedule("linear", 1.0, final_value=0.0, warmup_fraction=0.5, warmup_start_value=0.5)
    assert s(0.0) == pytest.approx(0.5)
    assert s(0.25) == pytest.approx(0.75)
    assert s(0.5) == pytest.approx(1.0)
    assert s(0.75) == pytest.approx(0.5)
    assert s(0.9) == pytest.approx(0.2)


def test_linear_without_warmup() -> None:
    s = build_schedule("linear", 2.0, final_value=1.0)
    assert s(0.0) == pytest.approx(2.0)
    assert s(0.25) == pytest.approx(1.75)


def test_unknown_name_names_closest_and_valid() -> None:
    with pytest.raises(ValueError, match="cosin") as info:
        build_schedule("cosin", 1.0)
    msg = str(info.value)
    assert "Did you mean 'cosine'" in msg
    assert all(n in msg for n in ("constant", "cosine", "linear"))


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_invalid_warmup_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="warmup_fraction"):
        build_schedule("cosine", 1.0, warmup_fraction=fraction)


def test_scaled_lr_rules() -> None:
    assert scaled_lr(0.3, 4096) == pytest.approx(4.8)  # linear is the default
    assert scaled_lr(0.3, 4096, rule="linear") == pytest.approx(4.8)
    assert scaled_lr(0.3, 256, rule="linear") == pytest.approx(0.3)
    assert scaled_lr(0.3, 128, rule="linear") == pytest.approx(0.15)
    assert scaled_lr(1.0, 1024, rule="sqrt") == pytest.approx(2.0)
    # SimCLR: lr = 0.075 * sqrt(B) is the sqrt rule with base 1.2
    for batch in (256, 1024, 4096):
        assert scaled_lr(1.2, batch, rule="sqrt") == pytest.approx(0.075 * math.sqrt(batch))
    assert scaled_lr(0.3, 4096, rule="none") == 0.3
    assert scaled_lr(0.1, 512, reference_batch_size=128) == pytest.approx(0.4)


def test_scaled_lr_errors() -> None:
    with pytest.raises(ValueError, match="Did you mean 'sqrt'"):
        scaled_lr(0.1, 256, rule="sqr")
    with pytest.raises(ValueError, match="positive"):
        scaled_lr(0.1, 0)


def test_every_per_update_value_is_a_clock_schedule_read_at_the_clock(tmp_path) -> None:
    """One mechanism: the dino recipe's lr, weight decay, teacher momentum and teacher temperature are each a
    ClockSchedule asked ``at(clock)``: the momentum and lr on progress ``update / max_steps`` (the last update
    clamped below 1), the temperature on the update count itself (DINO's linear warm-up, written out here)."""
    from helpers import RECIPES, SMALL

    from sslkit.builder import build_task
    from sslkit.clock import TrainClock
    from sslkit.config.compose import compose_config
    from sslkit.hooks.ema import MomentumTeacherHook
    from sslkit.optim.schedules import ClockSchedule, OnProgress, TeacherMomentum, TeacherTemperature

    temps = ["loss.warmup_teacher_temp=0.04", "loss.teacher_temp=0.07", "loss.warmup_teacher_temp_steps=10"]
    cfg = compose_config(["config=dino", *SMALL, *RECIPES["dino"], "optim.max_steps=40", "optim.final_lr=0.0",
                          *temps, "eval.knn.enabled=false", f"output_dir={tmp_path}"])
    task = build_task(cfg)
    try:
        (hook,) = [h for h in task.hooks if isinstance(h, MomentumTeacherHook)]
        assert isinstance(task.lr_schedule, OnProgress) and isinstance(task.wd_schedule, OnProgress)
        assert isinstance(hook.momentum, TeacherMomentum) and isinstance(task.loss.teacher_temp, TeacherTemperature)
        assert all(isinstance(s, ClockSchedule) for s in (task.lr_schedule, task.wd_schedule, hook.momentum,
                                                          task.loss.teacher_temp))
        base, final = hook.momentum.base, hook.momentum.final
        for update in (0, 5, 10, 25, 40):
            clock = TrainClock(step=update, max_steps=40)
            where = min(update / 40, 1 - 1e-9)
            assert hook.momentum.at(clock) == final - (final - base) * (math.cos(math.pi * where) + 1) / 2
            assert task.lr_schedule.at(clock) == task.lr_schedule.schedule(where)
            expected = 0.04 + 0.03 * update / 10 if update < 10 else 0.07
            assert task.loss.teacher_temp.at(clock) == pytest.approx(expected, rel=1e-12)
        assert task.lr_schedule.at(TrainClock(step=40, max_steps=40)) == pytest.approx(0.0, abs=1e-9)
    finally:
        task.close()


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_teacher_momentum_is_the_papers_formula(schedule: str) -> None:
    from sslkit.clock import TrainClock
    from sslkit.optim.schedules import TeacherMomentum

    m = TeacherMomentum(0.99, 1.0, schedule)
    expected = {"cosine": 1.0 - 0.01 * (math.cos(math.pi * 0.25) + 1) / 2, "linear": 0.99 + 0.01 * 0.25,
                "constant": 0.99}[schedule]
    assert m.at(TrainClock(step=10, max_steps=40)) == expected


def test_an_unknown_momentum_schedule_is_refused_when_the_hook_is_built() -> None:
    from sslkit.hooks.ema import MomentumTeacherHook

    with pytest.raises(ValueError, match=r"^unknown momentum schedule 'exp': use cosine, linear or constant$"):
        MomentumTeacherHook(0.99, 1.0, "exp")
