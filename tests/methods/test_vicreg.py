"""VICReg loss (Bardes et al. 2022, eq. 1-6) against the paper's formula written out with loops, plus invariances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SMALL, metrics, run_main

import sslkit.methods.vicreg as vr
from sslkit.methods.vicreg import VICRegLoss, covariance_term, variance_term, vicreg_loss

EPS = 1e-4


def _columns(z: list[list[float]]) -> tuple[int, int, list[float]]:
    n, d = len(z), len(z[0])
    means = [sum(z[k][j] for k in range(n)) / n for j in range(d)]
    return n, d, means


def reference_variance(z: torch.Tensor, eps: float = EPS) -> float:
    """Eq. 1: 1/d sum_j max(0, 1 - sqrt(Var(z_j) + eps)), unbiased variance."""
    a = z.double().tolist()
    n, d, means = _columns(a)
    total = 0.0
    for j in range(d):
        var = sum((a[k][j] - means[j]) ** 2 for k in range(n)) / (n - 1)
        total += max(0.0, 1.0 - (var + eps) ** 0.5)
    return total / d


def reference_covariance(z: torch.Tensor) -> float:
    """Eq. 3-4: C_ij = 1/(N-1) sum_b (z_bi - m_i)(z_bj - m_j); 1/d sum_{i != j} C_ij^2."""
    a = z.double().tolist()
    n, d, means = _columns(a)
    total = 0.0
    for i in range(d):
        for j in range(d):
            if i != j:
                c = sum((a[k][i] - means[i]) * (a[k][j] - means[j]) for k in range(n)) / (n - 1)
                total += c * c
    return total / d


def reference_vicreg(z1: torch.Tensor, z2: torch.Tensor, lam: float = 25.0, mu: float = 25.0,
                     nu: float = 1.0) -> dict[str, float]:
    """Eq. 5-6 with the reference code's averaging: invariance = mean squared difference over
    batch and dimensions; variance averaged over the branches; covariance summed over them."""
    a, b = z1.double().tolist(), z2.double().tolist()
    n, d = len(a), len(a[0])
    inv = sum((a[k][j] - b[k][j]) ** 2 for k in range(n) for j in range(d)) / (n * d)
    var = (reference_variance(z1) + reference_variance(z2)) / 2
    cov = reference_covariance(z1) + reference_covariance(z2)
    return {"loss": lam * inv + mu * var + nu * cov, "invariance": inv, "variance": var, "covariance": cov}


def _pair(seed: int, n: int = 7, d: int = 5, scale: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    # std ~0.7-0.9 per dimension: some variance hinges active, some not
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, generator=g) * scale
    z2 = z1 + 0.5 * torch.randn(n, d, generator=g)
    return z1, z2


@pytest.mark.parametrize("coeffs", [(25.0, 25.0, 1.0), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)])
def test_matches_reference(coeffs: tuple[float, float, float]) -> None:
    z1, z2 = _pair(0)
    ref = reference_vicreg(z1, z2, *coeffs)
    out = vicreg_loss(z1, z2, *coeffs)
    assert ref["variance"] > 0  # the hinge is active somewhere, so the term is exercised
    for key in ("loss", "invariance", "variance", "covariance"):
        assert out[key].item() == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key


def test_terms_match_reference() -> None:
    z1, _ = _pair(1, n=9, d=4, scale=0.8)
    assert variance_term(z1).item() == pytest.approx(reference_variance(z1), rel=1e-5)
    assert covariance_term(z1).item() == pytest.approx(reference_covariance(z1), rel=1e-5)


def test_invariant_to_batch_permutation_and_view_swap() -> None:
    z1, z2 = _pair(2, n=16, d=8)
    base = vicreg_loss(z1, z2)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    permuted = vicreg_loss(z1[perm], z2[perm])
    swapped = vicreg_loss(z2, z1)
    for key in base:
        assert torch.allclose(permuted[key], base[key], rtol=1e-5), key
        assert torch.allclose(swapped[key], base[key], rtol=1e-5), key


def test_known_values() -> None:
    z1, _ = _pair(3, n=10, d=6)
    # identical views: no invariance term
    assert vicreg_loss(z1, z1)["invariance"].item() == 0.0
    # every dimension with std >= 1: no variance term
    wide = (z1 - z1.mean(0)) / z1.std(0) * torch.tensor([1.0, 1.5, 2.0, 3.0, 1.0, 10.0])
    assert variance_term(wide).item() == 0.0
    # constant embeddings (collapse): the hinge is 1 - sqrt(eps) in every dimension
    const = torch.ones(10, 6)
    assert variance_term(const).item() == pytest.approx(1 - EPS**0.5, rel=1e-6)
    assert covariance_term(const).item() == 0.0


def test_hand_computed_covariance_2d() -> None:
    # columns a = (1, -1, 0, 0), b = (1, -1, 2, -2): both mean 0, cov_ab = (1 + 1) / (4 - 1) = 2/3
    # off-diagonal: 2 entries of (2/3)^2, divided by d = 2 -> 4/9 per branch
    z = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 2.0], [0.0, -2.0]])
    assert covariance_term(z).item() == pytest.approx(4 / 9, rel=1e-6)
    out = vicreg_loss(z, z, 25.0, 25.0, 1.0)
    assert out["covariance"].item() == pytest.approx(8 / 9, rel=1e-6)  # summed over the two branches
    # decorrelated columns: zero covariance term
    h = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    assert covariance_term(h).item() == pytest.approx(0.0, abs=1e-12)


def test_gradient_matches_reference_autograd() -> None:
    g = torch.Generator().manual_seed(4)
    z1 = (0.8 * torch.randn(6, 4, generator=g, dtype=torch.float64)).requires_grad_()
    z2 = (0.8 * torch.randn(6, 4, generator=g, dtype=torch.float64)).requires_grad_()

    # independent vectorisation: torch.cov / torch.std and an explicit off-diagonal mask
    def var_term(z: torch.Tensor) -> torch.Tensor:
        return torch.clamp(1 - torch.sqrt(torch.std(z, dim=0) ** 2 + EPS), min=0).mean()

    def cov_term(z: torch.Tensor) -> torch.Tensor:
        c = torch.cov(z.T)
        return (c * ~torch.eye(z.shape[1], dtype=torch.bool)).pow(2).sum() / z.shape[1]

    inv = ((z1 - z2) ** 2).sum() / z1.numel()
    ref = 25 * inv + 25 * (var_term(z1) + var_term(z2)) / 2 + cov_term(z1) + cov_term(z2)
    assert ref.item() == pytest.approx(reference_vicreg(z1.detach(), z2.detach())["loss"], rel=1e-10)
    ga = torch.autograd.grad(ref, [z1, z2])
    z1b, z2b = z1.detach().float().requires_grad_(), z2.detach().float().requires_grad_()
    gb = torch.autograd.grad(vicreg_loss(z1b, z2b)["loss"], [z1b, z2b])
    for a, b in zip(ga, gb):
        assert torch.allclose(a.float(), b, atol=1e-5, rtol=1e-4)


def test_variance_and_covariance_use_the_gathered_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a simulated 2-process run holds the first half of the batch; the gather gives the
    whole batch. Variance and covariance must be the whole batch's; invariance is the local mean
    (data parallelism averages it over the ranks)."""
    z1, z2 = _pair(5, n=12, d=6)
    full = vicreg_loss(z1, z2)
    l1, l2 = z1[:6].clone(), z2[:6].clone()
    others = {id(l1): z1[6:], id(l2): z2[6:]}
    monkeypatch.setattr(vr, "gather_with_grad", lambda x: torch.cat([x, others[id(x)]]))
    half = vicreg_loss(l1, l2)
    assert torch.allclose(half["variance"], full["variance"], rtol=1e-5)
    assert torch.allclose(half["covariance"], full["covariance"], rtol=1e-5)
    assert half["invariance"].item() == pytest.approx(reference_vicreg(l1, l2)["invariance"], rel=1e-5)
    # the mean of the two ranks' invariances is the global one
    rank1 = vicreg_loss(z1[6:], z2[6:], gather=False)["invariance"]
    assert torch.allclose((half["invariance"] + rank1) / 2, full["invariance"], rtol=1e-5)
    # without the gather, the half batch's statistics differ: the test above can fail
    local = vicreg_loss(l1, l2, gather=False)
    assert not torch.allclose(local["covariance"], full["covariance"], rtol=1e-3)


def test_gathered_gradient_matches_full_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    z1, z2 = _pair(6, n=8, d=4)
    z1.requires_grad_()
    # only the batch-statistics terms: their gradient on the local half must be the full batch's
    (g_full,) = torch.autograd.grad(vicreg_loss(z1, z2, 0.0, 25.0, 1.0)["loss"], z1)
    l1 = z1.detach()[:4].clone().requires_grad_()
    l2 = z2[:4].clone()
    others = {id(l1): z1.detach()[4:], id(l2): z2[4:]}
    monkeypatch.setattr(vr, "gather_with_grad", lambda x: torch.cat([x, others[id(x)]]))
    (g_local,) = torch.autograd.grad(vicreg_loss(l1, l2, 0.0, 25.0, 1.0)["loss"], l1)
    assert torch.allclose(g_local, g_full[:4], atol=1e-6)


def test_module_returns_detached_terms_and_checks_input() -> None:
    z1, z2 = _pair(7)
    z1.requires_grad_()
    out = VICRegLoss()({"projections": [z1, z2]}, {})
    assert set(out) == {"loss", "invariance", "variance", "covariance"}
    assert out["loss"].requires_grad and not any(out[k].requires_grad for k in ("invariance", "variance", "covariance"))
    assert torch.allclose(out["loss"], 25 * out["invariance"] + 25 * out["variance"] + out["covariance"])
    with pytest.raises(ValueError, match="two views"):
        VICRegLoss()({"projections": [z2]}, {})
    with pytest.raises(ValueError, match="at least 2"):
        vicreg_loss(torch.randn(1, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match="eps"):
        VICRegLoss(eps=0.0)
    with pytest.raises(ValueError, match="std_coeff"):
        VICRegLoss(std_coeff=-1.0)


@pytest.mark.slow
def test_recipe_runs_three_steps(tmp_path: Path) -> None:
    out = tmp_path / "vicreg"
    run_main("config=vicreg", *SMALL, "optim.max_steps=3", "eval.knn.enabled=false", f"output_dir={out}")
    text = (out / "config.yaml").read_text()
    assert "vicreg" in text and "collapse_monitor" in text
    train = [r for r in metrics(out) if r.get("phase") == "train"]
    assert train[-1]["step"] == 3
    assert {"loss", "invariance", "variance", "covariance", "embedding_std"} <= set(train[-1])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    state = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest.txt").read_text(), weights_only=False)
    assert "head.net.6.weight" in state["model"]  # the 3-layer expander; no other method state
    assert state["position"]["step"] == 3
