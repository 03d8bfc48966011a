"""The collapse monitor's statistic, the momentum schedule, and the multi-crop transform."""

from __future__ import annotations

import math

import pytest
import torch

from sslkit.data.transforms import build_multicrop
from sslkit.hooks.monitor import embedding_std
from sslkit.models.teacher import frozen_copy, update_momentum
from sslkit.optim.schedules import momentum_at


def test_embedding_std_collapsed_is_zero_and_spread_is_near_inverse_sqrt_d() -> None:
    d = 64
    assert embedding_std(torch.ones(128, d)).item() == pytest.approx(0.0, abs=1e-7)
    z = torch.randn(20000, d, generator=torch.Generator().manual_seed(0))
    assert embedding_std(z).item() == pytest.approx(1 / math.sqrt(d), rel=0.02)


def test_embedding_std_by_hand() -> None:
    # two samples, unit vectors e1 and e2: per-dim std (unbiased) of [1, 0] is sqrt(0.5)
    z = torch.tensor([[3.0, 0.0], [0.0, 5.0]])
    assert embedding_std(z).item() == pytest.approx(math.sqrt(0.5), rel=1e-6)


def test_momentum_schedules() -> None:
    assert momentum_at(0.0, 0.996) == pytest.approx(0.996)
    assert momentum_at(0.5, 0.996) == pytest.approx((0.996 + 1) / 2)
    assert momentum_at(0.999999, 0.99) == pytest.approx(1.0, abs=1e-9)
    assert momentum_at(0.7, 0.999, schedule="constant") == 0.999
    with pytest.raises(ValueError, match="unknown momentum schedule"):
        momentum_at(0.1, 0.9, schedule="exponential")
    assert momentum_at(0.25, 0.99, schedule="linear") == pytest.approx(0.9925)  # I-JEPA's


def test_update_momentum_moves_teacher_by_exactly_one_minus_m() -> None:
    student = torch.nn.Linear(3, 2)
    teacher = frozen_copy(student)
    assert all(not p.requires_grad for p in teacher.parameters())
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    before = [p.clone() for p in teacher.parameters()]
    update_momentum(student, teacher, 0.75)
    for t0, t, s in zip(before, teacher.parameters(), student.parameters()):
        assert torch.allclose(t - t0, 0.25 * (s - t0), atol=1e-7)
    with pytest.raises(ValueError):
        update_momentum(student, teacher, 1.5)


def test_multicrop_views_sizes_and_order() -> None:
    t = build_multicrop(image_size=28, small_size=12, num_large=2, num_small=3, blur_p=[1.0, 0.0])
    torch.manual_seed(0)
    views = t(torch.randint(0, 256, (1, 28, 28), dtype=torch.uint8))
    assert [tuple(v.shape) for v in views] == [(1, 28, 28)] * 2 + [(1, 12, 12)] * 3
    with pytest.raises(ValueError, match="blur_p has 3 values for 2 large crops"):
        build_multicrop(image_size=28, small_size=12, blur_p=[1.0, 0.1, 0.0])
