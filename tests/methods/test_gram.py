"""DINOv3's Gram anchoring parts: the Gram loss against loops written here and hand-computed cases, its options,
the high-resolution teacher's grid resizing, the snapshot updates and the loss-weight schedule against the
reference's rules written out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sslkit.clock import TrainClock
from sslkit.methods.gram import gram_loss, gram_matrix, gram_snapshot_at, gram_token_weights, resize_patch_grid
from sslkit.optim.schedules import WarmupCosine


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a @ b) / (a.norm() * b.norm()))


def _loop_image_level(s: torch.Tensor, t: torch.Tensor) -> float:
    """The definition, one image and one pair of patches at a time: the mean over images and pairs of the squared
    difference of the two cosine similarities."""
    total, count = 0.0, 0
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            for j in range(s.shape[1]):
                total += (_cos(s[b, i], s[b, j]) - _cos(t[b, i], t[b, j])) ** 2
                count += 1
    return total / count


def _features(seed: int, shape: tuple[int, ...] = (2, 5, 3)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def test_the_image_level_loss_is_the_mean_squared_difference_of_cosine_similarities() -> None:
    s, t = _features(0), _features(1)
    assert gram_loss(s, t).item() == pytest.approx(_loop_image_level(s, t), rel=1e-5)


def test_hand_computed_gram_losses() -> None:
    """Two patches: orthogonal student patches (Gram = I) against a teacher whose two patches point the same way
    (Gram = all ones): the two off-diagonal entries differ by 1, so the mean over 4 entries is 1/2; a student
    equal to its teacher up to each patch's length: 0."""
    student = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    teacher = torch.tensor([[[1.0, 0.0], [3.0, 0.0]]])
    assert gram_loss(student, teacher).item() == pytest.approx(0.5)
    assert gram_loss(teacher * torch.tensor([[[2.0], [0.5]]]), teacher).item() == pytest.approx(0.0, abs=1e-7)
    # without normalisation the Gram matrices hold dot products: [[1, 0], [0, 1]] against [[1, 3], [3, 9]]
    assert gram_loss(student, teacher, normalize=False).item() == pytest.approx((0 + 9 + 9 + 64) / 4)


def test_negative_similarities_dropped_in_both_or_only_where_the_teacher_has_them() -> None:
    """Opposite student patches (similarity -1) against an orthogonal teacher (0): kept, the off-diagonal entries
    differ by 1 (loss 1/2); dropped in both, the student's -1 becomes 0 (loss 0); dropped where the teacher is
    negative, the teacher is not (loss 1/2). The other way round, a negative teacher entry is set to 0; under
    ``shared`` the student's goes with it where the student's is negative too."""
    opposite = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])
    orthogonal = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    assert gram_loss(opposite, orthogonal).item() == pytest.approx(0.5)
    assert gram_loss(opposite, orthogonal, negatives="both").item() == pytest.approx(0.0)
    for negatives in ("teacher", "shared"):
        assert gram_loss(opposite, orthogonal, negatives=negatives).item() == pytest.approx(0.5)
        assert gram_loss(orthogonal, opposite, negatives=negatives).item() == pytest.approx(0.0)  # T -> I, S = I
    half = torch.tensor([[[1.0, 0.0], [-0.5, math.sqrt(0.75)]]])  # similarity -0.5 against the teacher's -1
    assert gram_loss(half, opposite, negatives="shared").item() == pytest.approx(0.0)  # both negative: both 0
    # DINOv3's code: the teacher's -1 becomes 0 and the student's -0.5 stays (two entries of 0.25, over 4)
    assert gram_loss(half, opposite, negatives="teacher").item() == pytest.approx(2 * 0.25 / 4)
    assert gram_loss(half, opposite).item() == pytest.approx(2 * 0.25 / 4)


def test_teacher_only_negatives_run_as_dinov3s_code_and_shared_as_its_comment() -> None:
    """``dinov3/loss/gram_loss.py`` (main) with ``remove_only_teacher_neg``, its two lines written out on random
    features: ``target_sim[target_sim < 0] = 0`` and then ``student_sim[(student_sim < 0) & (target_sim < 0)] = 0``
    on the already-zeroed teacher, then ``MSELoss``; ``shared`` is the same with the condition read first
    (dinov3 pull request #265)."""
    torch.manual_seed(0)
    s_feats, t_feats = torch.randn(3, 7, 5), torch.randn(3, 7, 5)
    s_sim = F.normalize(s_feats, dim=-1) @ F.normalize(s_feats, dim=-1).transpose(-1, -2)
    t_sim = F.normalize(t_feats, dim=-1) @ F.normalize(t_feats, dim=-1).transpose(-1, -2)
    target, student = t_sim.clone(), s_sim.clone()
    target[target < 0] = 0.0
    student[(student < 0) & (target < 0)] = 0.0
    reference = torch.nn.MSELoss()(student, target)
    assert torch.equal(student, s_sim)  # the student's mask is empty: the reference never changes it
    assert gram_loss(s_feats, t_feats, negatives="teacher").item() == pytest.approx(reference.item(), rel=1e-6)
    both_negative = (s_sim < 0) & (t_sim < 0)
    assert both_negative.any()
    shared = torch.nn.MSELoss()(s_sim.masked_fill(both_negative, 0.0), t_sim.clamp(min=0))
    assert gram_loss(s_feats, t_feats, negatives="shared").item() == pytest.approx(shared.item(), rel=1e-6)
    assert shared.item() != pytest.approx(reference.item(), rel=1e-3)


def test_the_batch_level_loss_with_a_token_selection_is_the_references_selected_rows() -> None:
    """Batch level: the B N patches of the batch in one Gram matrix; with the masked (or the visible) patches
    only, the reference's boolean selection ``patches[masks]`` of the flattened batch, done here with weights
    (a fixed shape): the same number."""
    s, t = _features(2, (3, 4, 6)), _features(3, (3, 4, 6))
    masks = torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    whole = F.mse_loss(gram_matrix(s.flatten(0, 1)), gram_matrix(t.flatten(0, 1)))
    assert gram_loss(s, t, image_level=False).item() == pytest.approx(whole.item(), rel=1e-6)
    for tokens, chosen in (("masked", masks), ("unmasked", ~masks)):
        weights = gram_token_weights(masks, tokens)
        reference = F.mse_loss(gram_matrix(s[chosen]), gram_matrix(t[chosen]))
        got = gram_loss(s, t, image_level=False, weights=weights)
        assert got.item() == pytest.approx(reference.item(), rel=1e-5), tokens
    assert gram_token_weights(masks, "all") is None


def test_the_loss_ignores_rotations_and_lengths_and_its_gradient_vanishes_at_the_teacher() -> None:
    s, t = _features(4, (2, 6, 4)), _features(5, (2, 6, 4))
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(6)))
    scale = torch.rand(2, 6, 1, generator=torch.Generator().manual_seed(7)) + 0.5
    for image_level in (True, False):
        base = gram_loss(s, t, image_level=image_level)
        assert gram_loss(s @ q * scale, t @ q.T, image_level=image_level).item() == pytest.approx(base.item(), rel=1e-5)
    student = t.clone().requires_grad_(True)
    loss = gram_loss(student, t)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-10) and student.grad.abs().max() < 1e-6


def test_inputs_the_loss_cannot_take_are_refused_with_what_would_work() -> None:
    s = _features(8)
    with pytest.raises(ValueError, match="use one of keep, both, teacher"):
        gram_loss(s, s, negatives="drop")
    with pytest.raises(ValueError, match=r"needs the batch-level Gram matrix \(gram.img_level=false\)"):
        gram_loss(s, s, weights=torch.ones(2, 5))
    with pytest.raises(ValueError, match="of one shape"):
        gram_loss(s, s[:, :4])
    with pytest.raises(ValueError, match="use one of all, masked, unmasked"):
        gram_token_weights(torch.zeros(2, 5, dtype=torch.bool), "some")


def test_the_high_resolution_teachers_grid_is_resized_to_the_students() -> None:
    """Raster order in and out (row by row), a constant map stays constant under bicubic resampling, the same
    grid is left alone, and a 2 x 3 map upsampled to 4 x 6 by nearest neighbours repeats each patch in its own
    2 x 2 block."""
    patches = torch.arange(6.0).reshape(1, 6, 1).repeat(1, 1, 2)  # patch k of a 2 x 3 grid holds k
    up = resize_patch_grid(patches, (2, 3), (4, 6), mode="nearest")
    expected = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5], [3, 3, 4, 4, 5, 5]],
                            dtype=torch.float32)
    assert torch.equal(up[0, :, 0].reshape(4, 6), expected)
    constant = torch.full((2, 64, 3), 0.25)
    torch.testing.assert_close(resize_patch_grid(constant, (8, 8), (4, 4)), torch.full((2, 16, 3), 0.25))
    assert resize_patch_grid(constant, (8, 8), (8, 8)) is constant
    with pytest.raises(ValueError, match="do not fill a 7 x 7 grid"):
        resize_patch_grid(constant, (7, 7), (4, 4))


def test_snapshots_follow_the_references_refresh_rule() -> None:
    """The reference loads the EMA teacher into the Gram teacher at iteration ``it_load_ema_teacher`` and then,
    after iteration ``it``, refreshes it when ``it + 1 >= it_first_update``, ``(it + 1) % update_frequency == 0``
    and fewer than ``max_steps`` refreshes were made: written out here, the snapshots it makes before each
    update are those of gram_snapshot_at."""
    start, every, first, most = 10, 5, 15, 3
    made, reference = 0, {start}
    for it in range(60):
        if it + 1 >= first and (it + 1) % every == 0 and made < most:
            reference.add(it + 1)  # refreshed after iteration it: the teacher of update it + 1
            made += 1
    assert {u for u in range(61) if gram_snapshot_at(u, start, every, most)} == reference == {10, 15, 20, 25}
    assert [u for u in range(40) if gram_snapshot_at(u, 7)] == [7]  # never refreshed
    assert [u for u in range(40) if gram_snapshot_at(u, 7, 10)] == [7, 17, 27, 37]  # no limit
    big = [u for u in range(999_000, 1_050_001) if gram_snapshot_at(u, 1_000_000, 10_000, 3)]
    assert big == [1_000_000, 1_010_000, 1_020_000, 1_030_000]  # DINOv3's ViT-7B Gram stage


def test_the_gram_weight_schedule_is_dinov3s_linear_warmup_cosine_decay() -> None:
    """dinov3/train/cosine_lr_scheduler.py's ``linear_warmup_cosine_decay``, written out with numpy as there:
    every update's value, an offset moving it to the Gram stage's start."""
    start, peak, end, warmup, cosine, total = 0.1, 1.0, 2.0, 7, 9, 20
    linear = np.linspace(start, peak, warmup, endpoint=False)
    curve = (peak - end) * (np.cos(np.linspace(0, np.pi, cosine)) + 1) / 2 + end
    reference = np.concatenate([linear, curve, np.full(total - warmup - cosine, end)])
    schedule = WarmupCosine(start, peak, end, warmup, cosine, offset=100)
    got = [schedule.at(TrainClock(step=100 + u)) for u in range(total)]
    np.testing.assert_allclose(got, reference, rtol=1e-12, atol=1e-12)
    assert schedule.at(TrainClock(step=50)) == start
    # the 7B Gram stage's (start 0, peak 0, end 2, a one-iteration "cosine"): 0 through the warm-up and the
    # cosine's single point (its start, the peak), then 2
    gram = WarmupCosine(0.0, 0.0, 2.0, 1000, 1)
    assert [gram.at(TrainClock(step=u)) for u in (0, 999, 1000, 1001, 5000)] == [0.0, 0.0, 0.0, 2.0, 2.0]
