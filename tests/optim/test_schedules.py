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
