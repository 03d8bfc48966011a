"""The high-resolution phase's data side: the per-update size draw, the sampler's update keys, the teacher's crops
(the same box at another size, written out here), and a dataset whose crops follow the update."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from sslkit.data import SSLDataset, StatefulDistributedSampler, collate_views
from sslkit.data.resolution import HighResPhase, PhasedTransform, phase_errors
from sslkit.data.sources import TensorImageDataset
from sslkit.data.transforms import build_multicrop, random_resized_crop_box

PHASE = HighResPhase(10, (48, 64, 64), (16, 16, 24), (96, 128, None), (0.3, 0.6, 0.1), seed=7)


def test_the_size_triple_is_drawn_per_update_with_the_ratios_and_none_before_the_phase() -> None:
    assert [PHASE.choice(u) for u in range(10)] == [None] * 10
    assert PHASE.stage(9) == "base" and PHASE.stage(10) == "high_res"
    draws = [PHASE.choice(u) for u in range(10, 30010)]
    again = HighResPhase(10, (48, 64, 64), (16, 16, 24), (96, 128, None), (0.3, 0.6, 0.1), seed=7)
    assert draws == [again.choice(u) for u in range(10, 30010)]  # a pure function of (seed, update): every rank
    counts = collections.Counter(draws)
    for index, ratio in enumerate(PHASE.ratios):  # 30000 draws: the binomial's sd is below 0.003
        assert abs(counts[index] / len(draws) - ratio) < 0.015, (index, counts)
    other = HighResPhase(10, (48, 64, 64), (16, 16, 24), (96, 128, None), (0.3, 0.6, 0.1), seed=8)
    assert draws[:200] != [other.choice(u) for u in range(10, 210)]
    single = HighResPhase(3, (64,), (32,), (None,), (1.0,))
    assert single.choice(2) is None and single.choice(3) == single.choice(999) == 0
    assert PHASE.sizes(1) == (64, 16, 128)


def test_the_sampler_names_the_update_of_each_sample_from_where_the_iteration_starts() -> None:
    plain = StatefulDistributedSampler(40, num_replicas=2, rank=1, seed=3)
    tracked = StatefulDistributedSampler(40, num_replicas=2, rank=1, seed=3, track_updates=True)
    for s in (plain, tracked):
        s.set_epoch(2)
        s.set_start(6)
    tracked.updates_from(31, 4)  # a resume at update 31: 4 of this rank's samples per update
    keys, pairs = list(tracked), list(plain)
    assert all(len(k) == 2 for k in pairs)
    assert [k[:2] for k in keys] == pairs  # the same samples, in the same order
    assert [k[2] for k in keys] == [31 + i // 4 for i in range(len(keys))]
    with pytest.raises(ValueError, match="per_update >= 1"):
        tracked.updates_from(0, 0)


def _image() -> torch.Tensor:
    return torch.randint(0, 256, (3, 50, 70), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def _expected_teacher_crop(seed: int, size: int, hflip_p: float) -> torch.Tensor:
    """The teacher crop of the first global view written out: the view's uniforms drawn as the transform draws
    them, its crop box, that box resized to ``size`` (bilinear, antialiased when shrinking), the view's flip, then
    the default normalisation ((x - 0.5) / 0.5)."""
    image = _image()
    torch.manual_seed(seed)
    u = torch.rand(54, dtype=torch.float64).tolist()
    top, left, h, w = random_resized_crop_box(u, 50, 70, (0.3, 1.0), (3 / 4, 4 / 3))
    crop = image[:, top:top + h, left:left + w].float() / 255
    out = F.interpolate(crop[None], size=(size, size), mode="bilinear", align_corners=False,
                        antialias=h > size or w > size)[0].clamp(0, 1)
    out = out.flip(-1) if u[40] < hflip_p else out
    return (out - 0.5) / 0.5


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_the_teacher_crop_is_the_global_crops_box_at_the_teacher_size_with_the_same_flip(seed: int) -> None:
    common = dict(image_size=32, small_size=16, num_large=2, num_small=2, crop_scale=(0.3, 1.0),
                  jitter_strength=0.5, grayscale_p=0.5, blur_p=[1.0, 0.5], solarize_p=[0.0, 0.5])
    plain = build_multicrop(**common)
    with_teacher = build_multicrop(**common, teacher_size=48)
    torch.manual_seed(seed)
    views = plain(_image())
    torch.manual_seed(seed)
    made = with_teacher(_image())
    assert len(made["views"]) == 4 and len(made["teacher_views"]) == 2  # one per global crop
    for a, b in zip(views, made["views"]):  # the teacher's crops draw nothing: the views are the plain transform's
        assert torch.equal(a, b)
    assert made["teacher_views"][0].shape == (3, 48, 48)
    # undistorted (DINOv3's gram_teacher_no_distortions): the box, resized, flipped as the view; no colour
    torch.testing.assert_close(made["teacher_views"][0], _expected_teacher_crop(seed, 48, 0.5), rtol=0, atol=1e-6)


def test_teacher_distortions_give_the_teacher_crop_the_views_colour_draws() -> None:
    gray = dict(image_size=32, small_size=16, num_large=2, num_small=0, crop_scale=(0.3, 1.0), jitter_strength=0.0,
                grayscale_p=1.0)
    torch.manual_seed(4)
    made = build_multicrop(**gray, teacher_size=64, teacher_distortions=True)(_image())
    teacher = made["teacher_views"][0]
    assert torch.equal(teacher[0], teacher[1]) and torch.equal(teacher[1], teacher[2])  # gray, as the view
    torch.manual_seed(4)
    undistorted = build_multicrop(**gray, teacher_size=64)(_image())["teacher_views"][0]
    assert not torch.equal(undistorted[0], undistorted[1])  # the colour crop


def test_a_dataset_under_a_phase_crops_each_sample_at_its_updates_sizes_and_collates_the_teacher_crops() -> None:
    phase = HighResPhase(2, (48, 64), (16, 24), (80, 96), (0.5, 0.5), seed=1)
    common = dict(num_large=2, num_small=2, crop_scale=(0.3, 1.0))
    base = build_multicrop(32, 16, **common)
    phased = PhasedTransform(base, phase, [build_multicrop(g, loc, **common, teacher_size=t)
                                           for g, loc, t in (phase.sizes(0), phase.sizes(1))])
    source = TensorImageDataset(torch.randint(0, 256, (8, 3, 40, 40), dtype=torch.uint8), torch.arange(8), 8)
    ds = SSLDataset(source, phased, seed=0)
    before = collate_views([ds[(0, i, 1)] for i in range(4)])
    assert [v.shape[-1] for v in before["input"]] == [32, 32, 16, 16] and "teacher_input" not in before
    for update in (2, 3, 4, 5):
        g, loc, t = phase.sizes(phase.choice(update))
        batch = collate_views([ds[(0, i, update)] for i in range(4)])
        assert [v.shape for v in batch["input"]] == [(4, 3, g, g)] * 2 + [(4, 3, loc, loc)] * 2
        assert [v.shape for v in batch["teacher_input"]] == [(4, 3, t, t)] * 2
    assert {phase.choice(u) for u in range(2, 12)} == {0, 1}
    assert torch.equal(ds[(0, 3)]["views"][0], ds[(0, 3, 0)]["views"][0])  # no update: the base transform


@pytest.mark.parametrize(("args", "message"), [
    ((5, [64], [32], [], [1.0], None, 10), "the trunk has no patch grid"),
    ((12, [64], [32], [], [1.0], 16, 12), "'hires.start_step' = 12 is after the run's end: it makes 12 steps"),
    ((0, [64, 72], [32, 32], [], [0.5, 0.5], 16, 10), "'hires.global_sizes' holds 72: every size must be a multiple "
                                                      "of the trunk's 16 px patch (e.g. 64)"),
    ((0, [64, 80], [32], [], [0.5, 0.5], 16, 10), "give as many hires.global_sizes, hires.local_sizes, hires.ratios "
                                                  "(now 2, 1, 2)"),
    ((0, [64], [80], [], [1.0], 16, 10), "'hires.local_sizes' holds 80 > the global size 64"),
    ((0, [64], [32], [100], [1.0], 16, 10), "'hires.teacher_sizes' holds 100"),
    ((0, [64, 80], [32, 32], [], [0, 0], 16, 10), "'hires.ratios' = [0, 0]: probabilities >= 0 with a positive sum"),
    ((-1, [64], [32], [], [1.0], 16, 10), "'hires.start_step' must be a step number >= 0"),
])
def test_a_phase_that_cannot_run_is_named_by_its_key(args: tuple, message: str) -> None:
    errors = phase_errors(*args)
    assert any(message in e for e in errors), errors
    assert phase_errors(None, [], [], [], [], None, 10) == []
    assert phase_errors(3, [64, 80], [32, 32], [128, None], [0.7, 0.3], 16, 10) == []
