"""LeJEPA: SIGReg against a numerical integral computed another way, its limits, the directions, the loss in loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sslkit.clock import StepContext, TrainClock
from sslkit.methods.lejepa import LeJEPALoss, epps_pulley, epps_pulley_knots, lejepa_loss, slice_directions


def _integral(x: np.ndarray, t_max: float = 3.0, points: int = 20001) -> float:
    """N * integral over [-t_max, t_max] of |ECF(t) - exp(-t^2/2)|^2 exp(-t^2/2) dt: the complex ECF of the samples on
    a fine grid of both signs, numpy's trapezoid rule (no symmetry folding, no cos/sin split)."""
    t = np.linspace(-t_max, t_max, points)
    ecf = np.exp(1j * np.outer(t, x)).mean(axis=1)
    integrand = np.abs(ecf - np.exp(-t**2 / 2)) ** 2 * np.exp(-t**2 / 2)
    return float(len(x) * np.trapezoid(integrand, t))


@pytest.mark.parametrize("kind", ["gaussian", "uniform", "shifted"])
def test_epps_pulley_is_the_weighted_integral_of_the_ecf_error(kind: str) -> None:
    g = np.random.default_rng(0)
    x = {"gaussian": g.standard_normal(300), "uniform": g.uniform(-2, 2, 300),
         "shifted": g.standard_normal(300) + 0.7}[kind]
    expected = _integral(x)
    column = torch.tensor(x, dtype=torch.float32)[:, None]
    fine = epps_pulley(column, *epps_pulley_knots(2001)).item()
    assert fine == pytest.approx(expected, rel=1e-4)
    coarse = epps_pulley(column, *epps_pulley_knots(17)).item()  # the reference code's 17 knots
    assert coarse == pytest.approx(expected, rel=0.05)


def test_gaussian_samples_give_a_small_statistic_and_collapsed_ones_a_large_one() -> None:
    g = torch.Generator().manual_seed(0)
    t, w = epps_pulley_knots()
    tt = np.linspace(-3, 3, 20001)
    # for Gaussian samples E[N |ECF - phi|^2] = 1 - exp(-t^2) (the variance of exp(itx)): the statistic's mean is
    # a constant, whatever N
    expected = np.trapezoid((1 - np.exp(-tt**2)) * np.exp(-tt**2 / 2), tt)
    for n in (256, 4096):
        gaussian = epps_pulley(torch.randn(n, 256, generator=g), t, w)
        assert gaussian.mean().item() == pytest.approx(expected, rel=0.1), n
    collapsed = epps_pulley(torch.zeros(4096, 1), t, w)  # every sample at 0: ECF = 1
    per_sample = np.trapezoid((1 - np.exp(-tt**2 / 2)) ** 2 * np.exp(-tt**2 / 2), tt)
    assert collapsed.item() == pytest.approx(4096 * per_sample, rel=0.02)
    assert collapsed.item() > 100 * gaussian.max().item()
    too_wide = epps_pulley(3 * torch.randn(4096, 1, generator=g), t, w)  # the right shape, the wrong scale
    assert too_wide.item() > 50 * gaussian.max().item()


def test_directions_are_unit_vectors_fixed_by_the_update() -> None:
    a = slice_directions(16, 32, update=5, device=torch.device("cpu"))
    assert a.shape == (16, 32) and torch.allclose(a.norm(dim=0), torch.ones(32), atol=1e-6)
    assert torch.equal(a, slice_directions(16, 32, update=5, device=torch.device("cpu")))
    assert not torch.equal(a, slice_directions(16, 32, update=6, device=torch.device("cpu")))


def test_loss_matches_algorithm_2_written_out() -> None:
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(5, 4, generator=g) for _ in range(4)]  # 2 global + 2 local
    directions = slice_directions(4, 6, update=0, device=torch.device("cpu"))
    t, w = epps_pulley_knots()
    got = lejepa_loss(views, 2, directions, t, w, lambd=0.3)
    inv = 0.0
    for v in views:
        for b in range(5):
            for k in range(4):
                centre = (views[0][b, k] + views[1][b, k]) / 2
                inv += float(centre - v[b, k]) ** 2
    inv /= 4 * 5 * 4
    sig = sum(float(epps_pulley((v @ directions[:, m:m + 1]), t, w)) for v in views for m in range(6)) / (4 * 6)
    assert got["invariance"].item() == pytest.approx(inv, rel=1e-5)
    assert got["sigreg"].item() == pytest.approx(sig, rel=1e-5)
    assert got["loss"].item() == pytest.approx(0.7 * inv + 0.3 * sig, rel=1e-5)


def test_the_module_draws_its_directions_on_the_training_clock_and_logs_both_terms() -> None:
    g = torch.Generator().manual_seed(2)
    out = {"projections": [torch.randn(8, 6, generator=g) for _ in range(3)]}
    loss = LeJEPALoss(num_slices=16)

    def at(update: int) -> dict:
        return loss(out, {}, StepContext(clock=TrainClock(step=update), train=True, device=torch.device("cpu")))

    first, again, later = at(3), at(3), at(4)
    assert torch.equal(first["loss"], again["loss"])
    assert torch.equal(first["invariance"], later["invariance"]) and not torch.equal(first["sigreg"], later["sigreg"])
    assert math.isclose(first["loss"].item(), 0.95 * first["invariance"].item() + 0.05 * first["sigreg"].item(),
                        rel_tol=1e-5)
    with pytest.raises(ValueError, match="odd"):
        LeJEPALoss(knots=16)
