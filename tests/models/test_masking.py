"""Masking: per-sample numbers from (seed, epoch, index, view), and the random, block and multi-block generators."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sslkit.models.masking import BlockMasking, MaskPlan, Masks, MultiBlockMasking, RandomMasking, SampleKeys, hash32


def _fmix32(x: int) -> int:
    """MurmurHash3's finaliser with Python integers (the reference for :func:`hash32`)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _keys(n: int = 64, seed: int = 0, epoch: int = 0, view: int = 0, start: int = 0) -> SampleKeys:
    return SampleKeys(seed, epoch, torch.arange(start, start + n), view)


def test_the_hash_is_murmur3s_finaliser_on_32_bit_words() -> None:
    values = [0, 1, 2, 12345, 0xFFFFFFFF, 0x80000000, 0xDEADBEEF]
    assert hash32(torch.tensor(values)).tolist() == [_fmix32(v) for v in values]


def test_a_samples_numbers_depend_on_its_identity_only() -> None:
    """The same (seed, epoch, index, view) gives the same numbers in any batch, any order, any batch size: what
    makes 1 and N processes, and a resumed run, draw the same masks."""
    whole = SampleKeys(3, 2, torch.tensor([7, 100, 5, 42]), 1).uniforms(50)
    alone = torch.cat([SampleKeys(3, 2, torch.tensor([i]), 1).uniforms(50) for i in (7, 100, 5, 42)])
    shuffled = SampleKeys(3, 2, torch.tensor([42, 5, 100, 7]), 1).uniforms(50)
    assert torch.equal(whole, alone) and torch.equal(whole, shuffled.flip(0))
    for change in ({"seed": 4}, {"epoch": 3}, {"view": 0}):
        other = SampleKeys(**{"seed": 3, "epoch": 2, "index": torch.tensor([7, 100, 5, 42]), "view": 1, **change})
        assert (other.uniforms(50) != whole).float().mean() > 0.99, change
    assert (SampleKeys(3, 2, torch.tensor([7]), 1).uniforms(50, tag=1) != whole[:1]).all()


def test_uniforms_are_uniform_and_exact_in_float32() -> None:
    u = _keys(512).uniforms(256)
    assert u.dtype == torch.float32 and 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=16, min=0.0, max=1.0) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.004
    assert torch.equal(u * (1 << 24), torch.floor(u * (1 << 24)))  # 24-bit fractions: the same on every device
    neighbours = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(neighbours.item()) < 0.01


# ---------------------------------------------------------------------------------------------- random
@pytest.mark.parametrize(("ratio", "grid"), [(0.75, (14, 14)), (0.75, (7, 7)), (0.5, (4, 4)), (0.0, (2, 3))])
def test_random_masking_keeps_a_fixed_number_of_patches_of_each_image(ratio: float, grid: tuple[int, int]) -> None:
    n = grid[0] * grid[1]
    m = RandomMasking(ratio)(_keys(32), grid)
    k = int(n * (1 - ratio))  # MAE's len_keep
    assert m.keep.shape == (32, k) and m.mask.shape == (32, n)
    assert (m.mask.sum(1) == n - k).all()
    assert (m.keep[:, 1:] > m.keep[:, :-1]).all()  # ascending, hence distinct
    assert not m.mask.gather(1, m.keep).any()  # the kept patches are the visible ones


def test_random_masks_are_uniform_over_positions_and_differ_between_images() -> None:
    m = RandomMasking(0.75)(_keys(2048), (7, 7))
    freq = m.mask.float().mean(0)
    assert (freq - 37 / 49).abs().max() < 0.04  # every position is hidden about as often
    assert len({tuple(r.tolist()) for r in m.keep}) > 2000


def test_restore_order_puts_kept_and_hidden_tokens_back_in_place() -> None:
    m = RandomMasking(0.6)(_keys(5), (3, 4))
    positions = torch.arange(12).expand(5, 12)
    hidden = torch.stack([positions[b][m.mask[b]] for b in range(5)])  # raster order, for the test only
    arranged = torch.cat([m.keep, hidden], dim=1)
    assert torch.equal(arranged.gather(1, m.restore_order()), positions)


# ----------------------------------------------------------------------------------------------- block
def _rectangles(mask: torch.Tensor, grid: tuple[int, int]) -> bool:
    """Whether a [H, W] mask is one axis-aligned rectangle."""
    rows, cols = mask.view(grid).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return True
    h, w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
    return bool(h * w == rows.numel())


def test_block_masking_masks_a_fraction_of_images_with_ratios_in_range() -> None:
    gen = BlockMasking(probability=0.5, ratio_min=0.1, ratio_max=0.5)
    keys = _keys(4096)
    target = gen.targets(keys, 196)
    masked = target > 0
    assert abs(masked.float().mean().item() - 0.5) < 0.03
    assert target[masked].min() >= math.floor(196 * 0.1) and target.max() <= math.floor(196 * 0.5)
    assert abs(target[masked].mean().item() - 196 * 0.3) < 2.0  # uniform ratios: mean 0.3
    m = gen(_keys(512), (14, 14))
    count = m.mask.sum(1).float()
    target = gen.targets(_keys(512), 196)
    assert (count <= target).all() and (count[target == 0] == 0).all()  # never above its target, BEiT's rule
    assert (count[target > 0] / target[target > 0]).mean() > 0.95  # and close to it
    assert m.keep is None and gen.mode == "replace"


def test_a_single_block_has_a_bounded_aspect_ratio() -> None:
    """With a target of 3..7 patches (2-4% of 196) and one attempt, the mask is one rectangle of at most its target,
    of aspect in [0.3, 1/0.3] up to the rounding of its sides (BEiT's area is uniform in [min_patches, target],
    which for a target below min_patches is [target, min_patches])."""
    gen = BlockMasking(probability=1.0, ratio_min=0.02, ratio_max=0.04, min_patches=4, max_patches=8, attempts=1)
    keys = _keys(256)
    m, target = gen(keys, (14, 14)), gen.targets(keys, 196)
    assert 0.75 < (m.mask.sum(1) > 0).float().mean()  # one attempt mostly succeeds (measured: 85%)
    for b in range(256):
        assert _rectangles(m.mask[b], (14, 14))
        rows, cols = m.mask[b].view(14, 14).nonzero(as_tuple=True)
        if rows.numel():
            h, w = int(rows.max() - rows.min() + 1), int(cols.max() - cols.min() + 1)
            assert h * w <= target[b] and max(h / w, w / h) <= (1 / 0.3) * 1.6


def test_block_masking_makes_blocks_not_scattered_patches() -> None:
    m = BlockMasking(probability=1.0, ratio_min=0.3, ratio_max=0.3)(_keys(64), (14, 14)).mask.view(64, 14, 14)
    # a masked patch mostly has masked neighbours (a random scatter of 30% would give about 30%)
    padded = torch.nn.functional.pad(m.float(), (1, 1, 1, 1))
    neighbours = (padded[:, :-2, 1:-1] + padded[:, 2:, 1:-1] + padded[:, 1:-1, :-2] + padded[:, 1:-1, 2:]) / 4
    assert neighbours[m].mean() > 0.6


# ----------------------------------------------------------------------------------------- multi-block
def test_multi_block_targets_are_blocks_of_the_configured_size_and_the_context_avoids_them() -> None:
    gen = MultiBlockMasking()  # I-JEPA's ImageNet config: 4 targets of 15-20%, context 85-100%
    grid, n = (14, 14), 196
    m = gen(_keys(256), grid)
    k = gen.num_context(grid)
    assert m.targets.shape == (256, 4, n) and m.keep.shape == (256, k) and m.keep_valid.shape == (256, k)
    assert k == 169  # the largest context block: 13 x 13 (I-JEPA keeps blocks below the grid's side)
    for b in range(256):
        sizes = {int(t.sum()) for t in m.targets[b]}
        assert len(sizes) == 1  # one block size per image
        (size,) = sizes
        assert math.floor(n * 0.15) * 0.6 <= size <= math.floor(n * 0.2) * 1.45
        assert all(_rectangles(t, grid) for t in m.targets[b])
    hidden = m.targets.any(1)
    seen = torch.zeros_like(hidden).scatter(1, m.keep, m.keep_valid)
    assert not (seen & hidden).any()  # no target patch is visible to the context encoder
    assert torch.equal(seen, ~m.mask)
    assert (m.keep[:, 1:] > m.keep[:, :-1]).all()
    context = m.keep_valid.sum(1).float()
    assert context.min() > 10 and context.mean() > 0.3 * n  # a real context is left (I-JEPA's min_keep: 10)


def test_a_smaller_context_keeps_a_random_subset() -> None:
    full = MultiBlockMasking()(_keys(64), (14, 14))
    cut = MultiBlockMasking(context_patches=40)(_keys(64), (14, 14))
    assert cut.keep.shape == (64, 40)
    assert (cut.keep_valid.sum(1) == torch.clamp(full.keep_valid.sum(1), max=40)).all()
    subset = torch.zeros(64, 196, dtype=torch.bool).scatter(1, cut.keep, cut.keep_valid)
    assert not (subset & full.mask).any()


def test_multi_block_counts_scales_and_aspects_over_many_draws() -> None:
    """4096 images on I-JEPA's grid: every block fits its slots (and the bound is reached), every target's area is
    the sampler's floor(N s) rounded to a rectangle, scales and aspect ratios spread over their ranges."""
    gen = MultiBlockMasking()
    grid, n = (14, 14), 196
    m = gen(_keys(4096), grid)
    sizes = m.targets.sum(-1)  # [B, T]
    assert (sizes == sizes[:, :1]).all()  # one size per image
    assert m.slots == gen.max_target_patches(grid) and int(sizes.max()) == m.slots  # the bound is tight here
    assert (m.keep_valid.sum(1) <= m.keep.shape[1]).all()
    rows = m.targets.view(4096, 4, 14, 14).any(-1).sum(-1).float()  # each block's height and width
    cols = m.targets.view(4096, 4, 14, 14).any(-2).sum(-1).float()
    assert torch.equal(rows * cols, sizes.float())  # rectangles
    scale = sizes[:, 0].float() / n
    assert scale.min() >= 0.12 and scale.max() <= 0.23  # floor(N s) for s in [0.15, 0.2], rounded to h x w
    assert 0.165 < scale.mean() < 0.185
    aspect = rows[:, 0] / cols[:, 0]  # h / w = round(sqrt(A a)) / round(sqrt(A / a))
    assert aspect.min() >= 0.75 * 0.7 and aspect.max() <= 1.5 * 1.3
    assert (aspect < 1).float().mean() > 0.15 and (aspect > 1).float().mean() > 0.35  # both sides of square drawn
    assert (m.keep_valid.sum(1) >= gen.least_context(grid)).all()


@pytest.mark.parametrize(("recipe", "grid", "draws"), [("ijepa", (7, 7), 20000), ("ijepa_vits16", (14, 14), 8000)])
def test_every_context_keeps_min_context_patches(recipe: str, grid: tuple[int, int], draws: int,
                                                tmp_path: Path) -> None:
    """The recipes' samplers over many draws: no context below min_context (on 7 x 7, 1 of 2000 draws was empty and 8
    kept 4 or fewer before). A draw whose context without the targets is too small takes back the last targets
    first, as I-JEPA's constrain_mask lifts them: its context is still inside its block and still excludes the
    first targets; every other draw keeps the strict context."""
    from sslkit.config.compose import compose_config

    (tmp_path / "a.jpg").touch()  # the folder check looks for an image file
    data = ["data=folder", f"data.train.path={tmp_path}"] if grid == (14, 14) else []  # each on its own images
    spec = {k: v for k, v in compose_config([f"config={recipe}", *data, "machine.device=cpu"]).masking.items()
            if k not in ("name", "views")}
    gen = MultiBlockMasking(**spec)
    keys = _keys(draws)
    m = gen(keys, grid)
    least = gen.least_context(grid)
    assert least == spec["min_context"]
    seen = torch.zeros_like(m.mask).scatter(1, m.keep, m.keep_valid)  # the context the encoder sees
    assert (seen.sum(1) >= least).all()
    targets, block = gen.blocks(keys, grid)
    strict = block & ~targets.any(1)
    short = strict.sum(1) < least
    assert short.sum() < 0.01 * draws and (short.any() or grid == (14, 14))  # rare; on 7 x 7 it happens
    assert not (seen[~short] & ~strict[~short]).any()
    assert not (seen & ~block).any()  # never outside the context block
    for i in short.nonzero()[:, 0].tolist():
        back = [j for j in range(4) if (seen[i] & targets[i, j]).any()]  # the targets it took patches back from
        assert back and back == list(range(4 - len(back), 4)), (i, back)  # the last ones


def test_multi_block_masks_are_a_function_of_seed_epoch_and_index_with_no_host_sync() -> None:
    from sslkit.launch.audit import StepAudit

    gen = MultiBlockMasking()
    whole = gen(_keys(64), (14, 14))
    with StepAudit() as audit:  # the sampler on the training device: no CPU tensor made, no value read on the host
        part = gen(SampleKeys(0, 0, torch.tensor([40, 3, 17])), (14, 14))
    assert audit.findings == []
    for i, b in enumerate((40, 3, 17)):  # a sample's masks do not depend on the batch it is in
        assert torch.equal(part.targets[i], whole.targets[b]) and torch.equal(part.mask[i], whole.mask[b])
    again = gen(_keys(64), (14, 14))
    assert torch.equal(again.targets, whole.targets) and torch.equal(again.keep, whole.keep)
    for other in (_keys(64, seed=1), _keys(64, epoch=1), _keys(64, view=1)):
        assert (gen(other, (14, 14)).targets != whole.targets).any(-1).any(-1).float().mean() > 0.9


def test_the_samplers_bias_and_cover_edges() -> None:
    context, target = MultiBlockMasking().coverage((14, 14), draws=2048)
    centre, corner = context[6:8, 6:8].mean(), context[0, 0]
    assert centre < 0.15 and corner > 0.85 and target[6:8, 6:8].mean() > 0.85  # the centre is rarely context
    assert context[-1].max() == 0 and context[:, -1].max() == 0 and target[-1].max() == 0  # I-JEPA's randint
    context, target = MultiBlockMasking(cover_edges=True).coverage((14, 14), draws=2048)
    assert context[-1].min() > 0.1 and context[:, -1].min() > 0.1 and target[-1].min() > 0.01


def test_a_grid_too_small_for_the_blocks_is_named() -> None:
    assert MultiBlockMasking().grid_errors((14, 14)) == []
    (error,) = MultiBlockMasking().grid_errors((4, 4))  # min_context 10 of 196 scaled: 1 of 16
    assert "fewer than min_context=1 patches once the targets are removed" in error and "masking.num_targets" in error
    (error,) = MultiBlockMasking(min_context=10).grid_errors((4, 4))  # a block of 3 x 3 at the least
    assert "'masking.min_context' = 10: more than the 9 patches the smallest context block" in error
    assert MultiBlockMasking(min_context=4).grid_errors((7, 7)) == []
    (error,) = MultiBlockMasking().grid_errors((2, 2))
    assert "too small for I-JEPA's blocks" in error


# --------------------------------------------------------------------------------------------- the stage
def test_the_plan_masks_the_global_views_with_their_own_grid_and_keys() -> None:
    plan = MaskPlan(RandomMasking(0.5), patch_size=4, seed=7)
    views = [torch.zeros(6, 1, 28, 28), torch.zeros(6, 1, 28, 28), torch.zeros(6, 1, 12, 12)]
    index = torch.tensor([3, 1, 4, 1, 5, 9])
    masks = plan(views, index, epoch=2)
    assert masks[2] is None and isinstance(masks[0], Masks) and masks[0].grid == (7, 7)
    expected = RandomMasking(0.5)(SampleKeys(7, 2, index, 1), (7, 7))
    assert torch.equal(masks[1].keep, expected.keep)
    assert not torch.equal(masks[0].keep, masks[1].keep)  # each view its own mask
    assert torch.equal(masks[0].keep[1], masks[0].keep[3])  # the same sample (index 1) twice: the same mask
    only_second = MaskPlan(RandomMasking(0.5), patch_size=4, seed=7, views=[1])(views, index, epoch=2)
    assert only_second[0] is None and torch.equal(only_second[1].keep, masks[1].keep)


def test_ratio_and_ranges_are_checked() -> None:
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"in \[0, 1\)"):
            RandomMasking(bad)
    with pytest.raises(ValueError, match=r"ratio_min=0\.6 is above masking\.ratio_max=0\.5"):
        BlockMasking(ratio_min=0.6, ratio_max=0.5)
    with pytest.raises(ValueError, match="target_scale"):
        MultiBlockMasking(target_scale=(0.3, 0.2))


def test_a_block_cap_given_as_a_share_is_that_share_of_each_grids_patches() -> None:
    """DINOv2 caps a mask block at half the grid (MaskingGenerator(max_num_patches=0.5 * N)): ``max_patches=0.5``
    draws the masks ``max_patches=98`` draws on a 14 x 14 grid and those of 1152 on a 48 x 48 one (a 768 px crop of
    a high-resolution phase), where a fixed 98 would cap a block at 4% of the grid."""
    keys = _keys(64)
    share = BlockMasking(probability=1.0, max_patches=0.5)
    assert share.block_cap(196) == 98 and share.block_cap(2304) == 1152 and share.block_cap(49) == 24
    assert torch.equal(share(keys, (14, 14)).mask, BlockMasking(probability=1.0, max_patches=98)(keys, (14, 14)).mask)
    large = share(keys, (48, 48)).mask
    assert torch.equal(large, BlockMasking(probability=1.0, max_patches=1152)(keys, (48, 48)).mask)
    assert not torch.equal(large, BlockMasking(probability=1.0, max_patches=98)(keys, (48, 48)).mask)
    assert BlockMasking(max_patches=None).block_cap(196) is None
    with pytest.raises(ValueError, match=r"a share of the patches must be in \(0, 1\]"):
        BlockMasking(max_patches=1.5)
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockMasking(max_patches=0)
