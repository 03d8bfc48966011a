"""NT-Xent (SimCLR eq. 1) against the paper's formula written out with python loops, plus invariances."""

from __future__ import annotations

import math

import pytest
import torch

from sslkit.methods.simclr import NTXentLoss, nt_xent


def reference_nt_xent(z1: torch.Tensor, z2: torch.Tensor, t: float) -> float:
    """Eq. 1 of Chen et al. (2020), one anchor at a time, over the 2N views [z1; z2]."""
    z = torch.cat([z1, z2]).double()
    n2 = z.shape[0]
    n = n2 // 2
    total = 0.0
    for i in range(n2):
        pos = (i + n) % n2
        def sim(a: int, b: int) -> float:
            return float(z[a] @ z[b] / (z[a].norm() * z[b].norm()))
        num = math.exp(sim(i, pos) / t)
        den = sum(math.exp(sim(i, k) / t) for k in range(n2) if k != i)
        total += -math.log(num / den)
    return total / n2


@pytest.mark.parametrize("t", [0.1, 0.5, 1.0])
def test_matches_reference(t: float) -> None:
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert nt_xent(z1, z2, t).item() == pytest.approx(reference_nt_xent(z1, z2, t), rel=1e-5)


def test_hand_computed_two_pairs() -> None:
    # Two images, two views each; views of image 0 point along e1, image 1 along e2.
    # For every anchor: positive sim 1, the two negatives sim 0, so
    # loss = -log(e^(1/T) / (e^(1/T) + 2))
    z1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z2 = torch.tensor([[2.0, 0.0], [0.0, 3.0]])  # scale must not matter
    t = 0.5
    expected = -math.log(math.exp(1 / t) / (math.exp(1 / t) + 2))
    assert nt_xent(z1, z2, t).item() == pytest.approx(expected, rel=1e-6)


def test_invariant_to_batch_permutation_and_view_swap() -> None:
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    base = nt_xent(z1, z2, 0.2)
    perm = torch.randperm(8, generator=g)
    assert torch.allclose(nt_xent(z1[perm], z2[perm], 0.2), base, atol=1e-6)
    assert torch.allclose(nt_xent(z2, z1, 0.2), base, atol=1e-6)


def test_aligned_views_beat_random_views() -> None:
    g = torch.Generator().manual_seed(2)
    z = torch.randn(16, 32, generator=g)
    assert nt_xent(z, z, 0.1) < nt_xent(z, torch.randn(16, 32, generator=g), 0.1)


def test_gradient_matches_reference_autograd() -> None:
    g = torch.Generator().manual_seed(3)
    z1 = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    z2 = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    # the same formula in vectorised form, independent of nt_xent's masking and indexing
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / 0.3
    n2 = sim.shape[0]
    eye = torch.eye(n2, dtype=torch.bool)
    pos = sim.roll(n2 // 2, dims=1).diagonal()
    ref = (torch.logsumexp(sim.masked_fill(eye, float("-inf")), dim=1) - pos).mean()
    ga = torch.autograd.grad(ref, [z1, z2])
    z1b, z2b = z1.detach().float().requires_grad_(), z2.detach().float().requires_grad_()
    gb = torch.autograd.grad(nt_xent(z1b, z2b, 0.3), [z1b, z2b])
    for a, b in zip(ga, gb):
        assert torch.allclose(a.float(), b, atol=1e-5)


def test_module_reads_projections_and_rejects_one_view() -> None:
    loss = NTXentLoss(temperature=0.5)
    z1, z2 = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(loss({"projections": [z1, z2]}, {}), nt_xent(z1, z2, 0.5))
    with pytest.raises(ValueError, match="two views"):
        loss({"projections": [z1]}, {})
    with pytest.raises(ValueError, match="temperature"):
        NTXentLoss(temperature=0.0)
