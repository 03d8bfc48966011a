"""KoLeo, Sinkhorn-Knopp and iBOT's masked-patch loss against computations written out here, on 1 and 2 processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dist_workers import dinov2_parts_on_shard, run_ranks

from sslkit.methods.dinov2_parts import gather_slots, koleo_loss, masked_patch_loss, masked_slots
from sslkit.methods.sinkhorn import sinkhorn_knopp
from sslkit.models.masking import BlockMasking, SampleKeys, batch_slots


def _koleo_by_loop(x: torch.Tensor, eps: float = 1e-8) -> float:
    z = [v / max(v.norm().item(), eps) for v in x.double()]
    total = 0.0
    for i, zi in enumerate(z):
        best = min((j for j in range(len(z)) if j != i), key=lambda j: (zi - z[j]).norm().item())
        total -= math.log((zi - z[best] + eps).norm().item() + eps)
    return total / len(z)


def test_koleo_is_minus_the_mean_log_distance_to_the_nearest_neighbour() -> None:
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(0)) * 5
    assert koleo_loss(x).item() == pytest.approx(_koleo_by_loop(x), rel=1e-5)


def test_koleo_hand_computed_points_on_a_circle() -> None:
    # 4 unit vectors at 0, 90, 180, 270 degrees (scaled: KoLeo normalises): every nearest neighbour is at sqrt(2)
    x = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [0.0, -0.5]])
    assert koleo_loss(x).item() == pytest.approx(-math.log(math.sqrt(2)), abs=1e-6)
    # spreading the points is what the loss rewards: 4 points bunched in a quarter circle cost more
    bunched = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.7, 0.3]])
    assert koleo_loss(bunched).item() > koleo_loss(x).item() + 1.0


def test_koleo_gradient_is_the_same_every_time_when_rows_share_a_neighbour() -> None:
    """512 rows in 8 tight clusters, so dozens share each nearest neighbour: the backward must add their
    gradients in a fixed order. Gathering with x[nearest] (index_put_'s atomic adds on the CPU) gave gradients
    differing by up to 5e-10 between identical calls, and two identical dinov2 runs differing by 6e-7."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 192, generator=g).repeat(64, 1) + 0.05 * torch.randn(512, 192, generator=g)
    grads = []
    for _ in range(10):
        x = x0.clone().requires_grad_(True)
        koleo_loss(x, gather=False).backward()
        grads.append(x.grad)
    assert all(torch.equal(grads[0], grad) for grad in grads[1:])


def test_koleo_on_duplicate_rows_is_large_and_finite() -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    x[3] = x[0]
    x.requires_grad_(True)
    loss = koleo_loss(x)
    loss.backward()
    assert 2.5 < loss.item() < 20 and torch.isfinite(x.grad).all()  # two of six terms at -log(~2e-8) = 17.7
    # every row with its twin (D = 32): each nearest-neighbour distance is ||0 + eps|| = eps sqrt(D) (pairwise_distance
    # adds eps to the difference), each term -log(eps sqrt(D) + eps) = 16.5, not -log(eps) = 18.4
    y = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    loss, rho = koleo_loss(torch.cat([y, y]), return_distance=True)
    assert rho.item() == pytest.approx(1e-8 * math.sqrt(32), rel=1e-3)
    assert loss.item() == pytest.approx(-math.log(1e-8 * (math.sqrt(32) + 1)), rel=1e-4)
    assert loss.item() == pytest.approx(16.525, abs=1e-3)


def _sinkhorn_by_loop(logits: torch.Tensor, temp: float, iterations: int) -> torch.Tensor:
    b, k = logits.shape
    q = [[math.exp(logits[i, j].item() / temp) for j in range(k)] for i in range(b)]
    total = sum(map(sum, q))
    q = [[v / total for v in row] for row in q]
    for _ in range(iterations):
        for j in range(k):
            col = sum(q[i][j] for i in range(b))
            for i in range(b):
                q[i][j] /= col * k
        for i in range(b):
            row = sum(q[i])
            q[i] = [v / (row * b) for v in q[i]]
    return torch.tensor(q, dtype=torch.float64) * b


def test_sinkhorn_knopp_equals_the_loop_and_balances_the_prototypes() -> None:
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(2)) * 2
    q = sinkhorn_knopp(logits, 0.5, iterations=3)
    torch.testing.assert_close(q.double(), _sinkhorn_by_loop(logits, 0.5, 3), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(q.sum(dim=1), torch.ones(10))  # rows are distributions
    more = sinkhorn_knopp(logits, 0.5, iterations=500)  # converged: every prototype gets B / K of the mass
    torch.testing.assert_close(more.sum(dim=0), torch.full((6,), 10 / 6), rtol=1e-4, atol=1e-4)


def test_sinkhorn_knopp_survives_logits_that_overflow_a_plain_exponential() -> None:
    logits = torch.randn(8, 5, generator=torch.Generator().manual_seed(4)) * 0.5
    assert not torch.isfinite(torch.exp((logits + 4) / 0.04)).all()  # a head without a normalised last layer
    q = sinkhorn_knopp(logits + 4, 0.04)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q, sinkhorn_knopp(logits, 0.04))  # a shift of every logit changes nothing


@pytest.mark.multiprocess
def test_two_processes_equal_one_process_on_the_doubled_batch(tmp_path: Path) -> None:
    n = 12
    ranks = run_ranks(dinov2_parts_on_shard, 2, str(tmp_path / "out"), n)
    g = torch.Generator().manual_seed(3)
    logits, x = torch.randn(n, 12, generator=g) * 3, torch.randn(n, 5, generator=g)
    x.requires_grad_(True)
    loss = koleo_loss(x)
    loss.backward()
    torch.testing.assert_close(torch.cat([r["q"] for r in ranks]), sinkhorn_knopp(logits, 0.1, iterations=3))
    for r in ranks:  # every rank computes the global batch's KoLeo
        torch.testing.assert_close(r["koleo"], loss.detach())
        assert r["max"].item() == logits.max().item()
    # each rank's gradient is the sum of every rank's (identical) loss: the world size times the one-process
    # gradient, which DDP's mean over ranks brings back
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks]) / 2, x.grad)


def test_masked_patch_loss_is_the_per_image_mean_over_masked_patches_then_the_batch_mean() -> None:
    g = torch.Generator().manual_seed(5)
    student, teacher = torch.randn(3, 4, 7, generator=g), torch.softmax(torch.randn(3, 4, 7, generator=g), -1)
    weight = torch.tensor([[1.0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]])  # image 1 unmasked: it adds 0
    total = 0.0
    for b in range(3):
        terms = [-(teacher[b, n] * torch.log_softmax(student[b, n] / 0.1, -1)).sum().item()
                 for n in range(4) if weight[b, n]]
        total += sum(terms) / len(terms) if terms else 0.0
    assert masked_patch_loss(student, teacher, weight, 0.1).item() == pytest.approx(total / 3, rel=1e-6)


def test_masked_patch_loss_over_one_buffer_of_slots_equals_the_per_image_layout() -> None:
    """The whole batch's slots in one buffer (in shuffled order, with padding of weight 0) and each slot's image:
    the same per-image means and their mean over every image, unmasked images included."""
    g = torch.Generator().manual_seed(9)
    student, teacher = torch.randn(5, 6, 7, generator=g), torch.softmax(torch.randn(5, 6, 7, generator=g), -1)
    weight = (torch.rand(5, 6, generator=g) < 0.4).float()
    weight[2] = 0.0
    expected = masked_patch_loss(student, teacher, weight, 0.1)
    order = torch.randperm(30, generator=g)
    image = torch.arange(5).repeat_interleave(6)[order]
    got = masked_patch_loss(student.reshape(30, 7)[order], teacher.reshape(30, 7)[order], weight.reshape(30)[order],
                            0.1, image=image, images=5)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="number of images"):
        masked_patch_loss(student.reshape(30, 7), teacher.reshape(30, 7), weight.reshape(30), 0.1, image=image)


def test_batch_slots_hold_every_masked_patch_of_dinov2_batches() -> None:
    """DINOv2's ViT-S/16 masking (14 x 14 patches, half the crops masked, 10-50 %, blocks up to 98 patches) over
    256 global crops: the bound holds what 40 batches hid (the most was well below it), is under half of what
    per-image places take, and the count moments bound the drawn counts' mean and match their spread."""
    gen = BlockMasking(probability=0.5, ratio_min=0.1, ratio_max=0.5, min_patches=4, max_patches=98)
    masks = gen(SampleKeys(0, 0, torch.arange(256)), (14, 14))
    bound = batch_slots(masks, 256)
    assert bound < 0.45 * 256 * gen.max_masked(196)
    counts = torch.stack([gen(SampleKeys(0, step, torch.arange(256)), (14, 14)).mask.sum(1) for step in range(40)])
    mean, var = gen.count_moments(196)
    assert counts.sum(1).max().item() < bound
    assert counts.float().mean().item() <= mean
    assert counts.float().var().item() == pytest.approx(var, rel=0.15)
    assert batch_slots(masks, 2) == 2 * gen.max_masked(196)  # a small batch: every image at its bound


def test_masked_slots_put_each_image_s_masked_patches_first() -> None:
    tokens = torch.arange(2 * 5, dtype=torch.float32).view(2, 5, 1)
    mask = torch.tensor([[False, True, False, True, False], [True, False, False, False, False]])
    index, weight = masked_slots(mask, 3)
    out = gather_slots(tokens, index)
    assert out[0, :2, 0].tolist() == [1.0, 3.0] and weight[0].tolist() == [1.0, 1.0, 0.0]
    assert out[1, 0, 0].item() == 5.0 and weight[1].tolist() == [1.0, 0.0, 0.0]


def test_block_masks_never_hide_more_than_max_masked() -> None:
    gen = BlockMasking(probability=1.0, ratio_min=0.1, ratio_max=0.5)
    for grid in [(4, 4), (7, 7), (14, 14)]:
        keys = SampleKeys(0, 0, torch.arange(512))
        counts = gen(keys, grid).mask.sum(dim=1)
        assert counts.max().item() <= gen.max_masked(grid[0] * grid[1])


def test_sinkhorn_knopp_with_weights_is_sinkhorn_knopp_on_the_real_rows_alone() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(12, 5, generator=g)
    weight = (torch.rand(12, generator=g) < 0.6).float()
    logits[weight == 0] += 100.0  # padding with huge logits changes nothing (and does not overflow)
    q = sinkhorn_knopp(logits, 0.1, 3, weight)
    real = weight.bool()
    torch.testing.assert_close(q[real], sinkhorn_knopp(logits[real], 0.1, 3))
    assert torch.equal(q[~real], torch.zeros_like(q[~real]))
    assert torch.equal(sinkhorn_knopp(logits, 0.1, 3, torch.zeros(12)), torch.zeros(12, 5))  # no real row: zeros
