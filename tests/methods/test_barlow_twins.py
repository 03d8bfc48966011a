"""Barlow Twins loss (Zbontar et al. 2021, eq. 1-2) against the paper's formula written with loops, plus invariances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SMALL, metrics, run_main

import sslkit.methods.barlow_twins as bt
from sslkit.methods.barlow_twins import BarlowTwinsLoss, barlow_twins_loss, cross_correlation

EPS = 1e-5


def reference_cross_correlation(z1: torch.Tensor, z2: torch.Tensor, eps: float = EPS) -> list[list[float]]:
    """Eq. 2, one entry at a time: standardise each dimension over the batch (biased variance, as
    BatchNorm does), then C_ij = sum_b z1n_bi z2n_bj / N."""
    a, b = z1.double().tolist(), z2.double().tolist()
    n, d = len(a), len(a[0])

    def standardised(z: list[list[float]]) -> list[list[float]]:
        out = [[0.0] * d for _ in range(n)]
        for j in range(d):
            mean = sum(z[k][j] for k in range(n)) / n
            var = sum((z[k][j] - mean) ** 2 for k in range(n)) / n
            for k in range(n):
                out[k][j] = (z[k][j] - mean) / (var + eps) ** 0.5
        return out

    an, bn = standardised(a), standardised(b)
    return [[sum(an[k][i] * bn[k][j] for k in range(n)) / n for j in range(d)] for i in range(d)]


def reference_loss(z1: torch.Tensor, z2: torch.Tensor, lambd: float, eps: float = EPS) -> float:
    """Eq. 1: sum_i (1 - C_ii)^2 + lambd * sum_i sum_{j != i} C_ij^2, with explicit loops."""
    c = reference_cross_correlation(z1, z2, eps)
    d = len(c)
    on = sum((1 - c[i][i]) ** 2 for i in range(d))
    off = sum(c[i][j] ** 2 for i in range(d) for j in range(d) if i != j)
    return on + lambd * off


def _pair(seed: int, n: int = 7, d: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, generator=g) * 2 + 1
    z2 = 0.6 * z1 + torch.randn(n, d, generator=g)  # correlated views, so C is not ~0
    return z1, z2


def _hadamard8() -> torch.Tensor:
    h = torch.tensor([[1.0]])
    for _ in range(3):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("lambd", [0.0051, 0.5, 2.0])
def test_cross_correlation_and_loss_match_reference(lambd: float) -> None:
    z1, z2 = _pair(0)
    c = cross_correlation(z1, z2, EPS)
    assert torch.allclose(c.double(), torch.tensor(reference_cross_correlation(z1, z2), dtype=torch.float64), atol=1e-5)
    assert barlow_twins_loss(z1, z2, lambd).item() == pytest.approx(reference_loss(z1, z2, lambd), rel=1e-5)


def test_matches_reference_without_eps() -> None:
    z1, z2 = _pair(1, n=6, d=3)
    assert barlow_twins_loss(z1, z2, 0.3, eps=0.0).item() == pytest.approx(reference_loss(z1, z2, 0.3, 0.0), rel=1e-5)


def test_invariant_to_batch_permutation_and_view_swap() -> None:
    z1, z2 = _pair(2, n=16, d=8)
    base = barlow_twins_loss(z1, z2)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(barlow_twins_loss(z1[perm], z2[perm]), base, rtol=1e-5)
    # swapping the views transposes C; the loss (diagonal and sum of squares) is unchanged
    assert torch.allclose(cross_correlation(z2, z1), cross_correlation(z1, z2).T, atol=1e-6)
    assert torch.allclose(barlow_twins_loss(z2, z1), base, rtol=1e-5)


def test_invariant_to_per_dimension_affine_maps() -> None:
    # standardisation removes a per-dimension shift and positive scale of either view (exactly
    # without eps; with eps a dimension of small variance is shrunk a little)
    z1, z2 = _pair(3)
    scale, shift = torch.tensor([0.5, 2.0, 3.0, 10.0, 0.1]), torch.tensor([1.0, -4.0, 0.0, 7.0, 2.0])
    moved = barlow_twins_loss(z1 * scale + shift, z2, eps=0.0)
    assert torch.allclose(moved, barlow_twins_loss(z1, z2, eps=0.0), rtol=1e-5)


def test_identical_decorrelated_views_give_zero() -> None:
    # Columns 1..4 of a Hadamard matrix: mean 0, variance 1, mutually orthogonal -> C = I.
    z = _hadamard8()[:, 1:5]
    assert barlow_twins_loss(z, z).item() == pytest.approx(0.0, abs=1e-8)
    # any per-dimension scale and shift of the same embeddings too
    assert barlow_twins_loss(3 * z + 5, z - 1).item() == pytest.approx(0.0, abs=1e-8)


def test_hand_computed_values() -> None:
    z = _hadamard8()[:, 1:5]
    d = z.shape[1]
    # anti-aligned views: C = -I, so each diagonal term is (1 - (-1))^2 = 4 and nothing off-diagonal
    assert barlow_twins_loss(z, -z, eps=0.0).item() == pytest.approx(4.0 * d, rel=1e-6)
    # two identical dimensions: C = [[1, 1], [1, 1]] -> on 0, off 2 -> loss 2 * lambd
    dup = torch.stack([z[:, 0], z[:, 0]], dim=1)
    assert barlow_twins_loss(dup, dup, lambd=0.25, eps=0.0).item() == pytest.approx(0.5, rel=1e-6)


def test_gradient_matches_reference_autograd() -> None:
    g = torch.Generator().manual_seed(4)
    z1 = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    z2 = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    lambd = 0.2
    # independent vectorisation: BatchNorm's functional form for the standardisation, einsum for C
    n1 = torch.nn.functional.batch_norm(z1, None, None, training=True, eps=EPS)
    n2 = torch.nn.functional.batch_norm(z2, None, None, training=True, eps=EPS)
    c = torch.einsum("bi,bj->ij", n1, n2) / z1.shape[0]
    eye = torch.eye(4, dtype=torch.bool)
    ref = ((1 - c[eye]) ** 2).sum() + lambd * (c[~eye] ** 2).sum()
    assert ref.item() == pytest.approx(reference_loss(z1.detach(), z2.detach(), lambd), rel=1e-10)
    ga = torch.autograd.grad(ref, [z1, z2])
    z1b, z2b = z1.detach().float().requires_grad_(), z2.detach().float().requires_grad_()
    gb = torch.autograd.grad(barlow_twins_loss(z1b, z2b, lambd), [z1b, z2b])
    for a, b in zip(ga, gb):
        assert torch.allclose(a.float(), b, atol=1e-5, rtol=1e-4)


def test_statistics_use_the_gathered_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a simulated 2-process run holds the first half of the batch; the gather gives the
    whole batch (in rank order). Loss and gradient of the local half must be those of one process
    with the whole batch."""
    z1, z2 = _pair(5, n=12, d=6)
    z1 = z1.requires_grad_()
    full = barlow_twins_loss(z1, z2)
    (g_full,) = torch.autograd.grad(full, z1)

    local1, local2 = z1.detach()[:6].clone().requires_grad_(), z2[:6].clone()
    others = {id(local1): z1.detach()[6:], id(local2): z2[6:]}
    calls: list[int] = []

    def fake_gather(x: torch.Tensor) -> torch.Tensor:
        # the loss casts to float32 (a no-op on these float32 leaves), so ids still match
        calls.append(id(x))
        return torch.cat([x, others[id(x)]])

    monkeypatch.setattr(bt, "gather_with_grad", fake_gather)
    loss = barlow_twins_loss(local1, local2)
    assert len(calls) == 2
    assert torch.allclose(loss, full, rtol=1e-5)
    (g_local,) = torch.autograd.grad(loss, local1)
    assert torch.allclose(g_local, g_full[:6], atol=1e-6)
    # without the gather, the half batch gives a different value: the test above can fail
    assert not torch.allclose(barlow_twins_loss(local1, local2, gather=False), full, rtol=1e-3)


def test_module_returns_terms_and_scale() -> None:
    z1, z2 = _pair(6)
    out = BarlowTwinsLoss(lambd=0.1)({"projections": [z1, z2]}, {})
    assert set(out) == {"loss", "on_diagonal", "off_diagonal"}
    assert torch.allclose(out["loss"], out["on_diagonal"] + 0.1 * out["off_diagonal"])
    assert torch.allclose(out["loss"], barlow_twins_loss(z1, z2, 0.1))
    assert not out["on_diagonal"].requires_grad
    scaled = BarlowTwinsLoss(lambd=0.1, scale_loss=0.024)({"projections": [z1, z2]}, {})
    assert torch.allclose(scaled["loss"], 0.024 * out["loss"])
    assert torch.equal(scaled["on_diagonal"], out["on_diagonal"])  # logged terms are unscaled


def test_module_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="two views"):
        BarlowTwinsLoss()({"projections": [torch.randn(4, 3)]}, {})
    with pytest.raises(ValueError, match="at least 2"):
        barlow_twins_loss(torch.randn(1, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match="lambd"):
        BarlowTwinsLoss(lambd=-1.0)
    with pytest.raises(ValueError, match="scale_loss"):
        BarlowTwinsLoss(scale_loss=0.0)


def test_bf16_autocast_keeps_float32_precision() -> None:
    z1, z2 = _pair(7, n=64, d=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = cross_correlation(z1.bfloat16(), z2.bfloat16())
    assert c.dtype == torch.float32
    assert torch.allclose(c, cross_correlation(z1.bfloat16().float(), z2.bfloat16().float()), atol=1e-6)


@pytest.mark.slow
def test_recipe_runs_three_steps(tmp_path: Path) -> None:
    out = tmp_path / "bt"
    run_main("config=barlow_twins", *SMALL, "optim.max_steps=3", "eval.knn.enabled=false", f"output_dir={out}")
    text = (out / "config.yaml").read_text()
    assert "barlow_twins" in text and "collapse_monitor" in text
    train = [r for r in metrics(out) if r.get("phase") == "train"]
    assert train[-1]["step"] == 3
    assert {"loss", "on_diagonal", "off_diagonal", "embedding_std"} <= set(train[-1])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    state = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest.txt").read_text(), weights_only=False)
    # no method state beyond the model: the 3-layer projector (Linear-BN-ReLU x2, Linear) is in it
    assert "head.net.6.weight" in state["model"]
    assert state["position"]["step"] == 3
