"""I-JEPA: the loss against smooth L1 written out, the predictor's padding and blocks, the wiring, the recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import RECIPES, SMALL, run_main

from sslkit.methods.ijepa import IJEPALoss, IJEPAPredictor, build_ijepa, ijepa_loss
from sslkit.models.masking import MultiBlockMasking, SampleKeys
from sslkit.models.vit import build_vit
from sslkit.optim.schedules import momentum_at


def _smooth_l1(x: float, beta: float) -> float:
    return x * x / (2 * beta) if abs(x) < beta else abs(x) - beta / 2


def _loss_by_loop(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, beta: float) -> float:
    """Per target block: the mean of smooth L1 over its patches' elements; the mean over blocks and images."""
    b_, t_, m_, d_ = pred.shape
    total = 0.0
    for b in range(b_):
        for t in range(t_):
            s, count = 0.0, 0.0
            for m in range(m_):
                if weight[b, t, m] > 0:
                    s += sum(_smooth_l1(float(pred[b, t, m, d] - target[b, t, m, d]), beta) for d in range(d_)) / d_
                    count += 1
            total += s / max(count, 1.0)
    return total / (b_ * t_)


def test_loss_is_smooth_l1_per_target_block_written_out() -> None:
    # hand-computed: errors 0.5 (0.125) and 2 (1.5) for beta 1: one block of two patches with one element each
    pred = torch.zeros(1, 1, 3, 1)
    target = torch.tensor([0.5, 2.0, 100.0]).view(1, 1, 3, 1)
    weight = torch.tensor([[[1.0, 1.0, 0.0]]])  # the third slot is padding
    assert ijepa_loss(pred, target, weight).item() == pytest.approx((0.125 + 1.5) / 2)
    assert ijepa_loss(pred, target, weight, beta=4.0).item() == pytest.approx((0.25 / 8 + 4 / 8) / 2)
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 5, 6, generator=g) * 2, torch.randn(3, 4, 5, 6, generator=g)
    weight = (torch.rand(3, 4, 5, generator=g) > 0.3).float()
    weight[0, 0] = 0  # an empty block adds 0
    for beta in (1.0, 0.5):
        assert ijepa_loss(pred, target, weight, beta).item() == pytest.approx(
            _loss_by_loop(pred, target, weight, beta), rel=1e-5)
    # with blocks of one size it is the reference's F.smooth_l1_loss(z, h), the mean of every element
    full = torch.ones(3, 4, 5)
    assert ijepa_loss(pred, target, full).item() == pytest.approx(F.smooth_l1_loss(pred, target).item(), rel=1e-6)


def _predictor(grid: tuple[int, int] = (4, 4)) -> IJEPAPredictor:
    torch.manual_seed(0)
    return IJEPAPredictor(in_dim=12, grid=grid, dim=16, depth=2, num_heads=2).eval()


def test_predictor_ignores_padding_and_predicts_each_block_on_its_own() -> None:
    pred = _predictor()
    g = torch.Generator().manual_seed(1)
    context = torch.randn(2, 5, 12, generator=g)
    c_index = torch.tensor([[0, 1, 2, 4, 5], [3, 6, 7, 8, 9]])
    c_valid = torch.tensor([[True, True, True, True, False], [True, True, False, True, False]])
    t_index = torch.tensor([[[10, 11, 14], [12, 13, 15]], [[0, 1, 2], [12, 13, 14]]])
    t_valid = torch.tensor([[[True, True, False], [True, True, True]], [[True, True, True], [True, False, False]]])
    out = pred(context, c_index, c_valid, t_index, t_valid, (4, 4))
    assert out.shape == (2, 2, 3, 12)
    # padded context tokens change nothing (neither their features nor their positions)
    other = context.clone()
    other[~c_valid] = 50.0
    moved = c_index.clone()
    moved[~c_valid] = 15
    again = pred(other, moved, c_valid, t_index, t_valid, (4, 4))
    torch.testing.assert_close(again[t_valid], out[t_valid])
    # a padded target slot changes no real prediction; a block's predictions do not depend on the other block
    t_other = t_index.clone()
    t_other[0, 0, 2] = 3
    t_other[:, 1] = torch.tensor([5, 6, 7])
    again = pred(context, c_index, c_valid, t_other, t_valid, (4, 4))
    torch.testing.assert_close(again[:, 0][t_valid[:, 0]], out[:, 0][t_valid[:, 0]])
    # the prediction of a patch depends on its position (the fixed sine-cosine embedding of the mask token)
    assert not torch.allclose(out[0, 0, 0], out[0, 0, 1])
    assert not pred.pos_embed.requires_grad and "pos_embed" not in dict(pred.named_parameters())


def test_predictor_initialisation_follows_the_reference() -> None:
    pred = IJEPAPredictor(in_dim=64, grid=(4, 4), dim=128, depth=4, num_heads=4)
    std = pred.embed.weight.std().item()
    assert std == pytest.approx(0.02, rel=0.1)  # truncated at +-2 (absolute, as the reference): a normal of std 0.02
    assert pred.embed.bias.abs().sum() == 0 and pred.mask_token.std().item() == pytest.approx(0.02, rel=0.3)
    for i, block in enumerate(pred.blocks, start=1):  # output projections rescaled by 1 / sqrt(2 i)
        assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * i), rel=0.1)
        assert block.mlp.fc2.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * i), rel=0.1)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)


def _model():
    torch.manual_seed(0)
    trunk = build_vit("vit_tiny", in_channels=1, img_size=24, patch_size=4, depth=2, num_heads=2, pool="avg",
                      pos_embed="sincos")
    return build_ijepa(trunk, predictor_dim=16, predictor_depth=1).eval()


def _masks(b: int = 4, grid: tuple[int, int] = (6, 6)):
    return MultiBlockMasking(min_context=2)(SampleKeys(0, 0, torch.arange(b)), grid)


def test_targets_are_the_teachers_layer_normed_patches_and_the_student_never_sees_them() -> None:
    model = _model()
    x = torch.randn(4, 1, 24, 24)
    m = _masks()
    out = model([x], [m])
    b, t, _ = m.targets.shape
    assert out["predictions"][0].shape == (4, t, m.slots, model.trunk.out_dim)
    with torch.no_grad():
        h = model.teacher_trunk.forward_tokens(x).patches
    for i in range(b):
        for j in range(t):
            block = m.targets[i, j].nonzero().flatten()  # the block's patches in raster order
            expected = F.layer_norm(h[i, block], (h.shape[-1],))
            count = len(block)
            assert out["patch_weights"][0][i, j].sum() == count
            torch.testing.assert_close(out["targets"][0][i, j, :count], expected)
    # the features are the mean of the context's patch tokens
    ctx = model.trunk.forward_tokens(x, keep=m.keep, keep_valid=m.keep_valid).patches
    for i in range(b):
        torch.testing.assert_close(out["features"][0][i], ctx[i][m.keep_valid[i]].mean(0))
    # changing pixels the context does not hold (the targets among them) changes no prediction
    hidden = m.mask.view(b, 6, 6).repeat_interleave(4, 1).repeat_interleave(4, 2)[:, None]
    noisy = torch.where(hidden, torch.randn_like(x) * 5, x)
    again = model([noisy], [m])
    w = out["patch_weights"][0].bool()
    torch.testing.assert_close(again["predictions"][0][w], out["predictions"][0][w])
    assert not torch.allclose(again["targets"][0][w], out["targets"][0][w])  # the teacher sees them
    loss = IJEPALoss()(out, {})
    loss["loss"].backward()
    assert all(p.grad is None for p in model.teacher_trunk.parameters())
    assert model.predictor.mask_token.grad.abs().sum() > 0 and model.trunk.patch_embed.proj.weight.grad is not None
    assert 0.5 < loss["target_std"].item() < 1.5  # layer-normalised targets of a random net: spread


def test_ijepa_refuses_masks_without_targets_and_a_head() -> None:
    model = _model()
    from sslkit.models.masking import RandomMasking

    with pytest.raises(ValueError, match="multi_block"):
        model([torch.randn(2, 1, 24, 24)], [RandomMasking(0.5)(SampleKeys(0, 0, torch.arange(2)), (6, 6))])
    with pytest.raises(ValueError, match="head"):
        build_ijepa(model.trunk, torch.nn.Linear(4, 4))


def test_momentum_is_linear_from_base_to_final() -> None:
    assert momentum_at(0.0, 0.996, 1.0, "linear") == 0.996
    assert momentum_at(0.5, 0.996, 1.0, "linear") == pytest.approx(0.998)
    assert momentum_at(0.25, 0.99, 1.0, "linear") == pytest.approx(0.9925)


def test_a_grid_too_small_for_the_blocks_is_a_config_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    small = [*SMALL, *RECIPES["ijepa"][1:]]
    proc = run_main("config=ijepa", *small, "model.trunk_kwargs={patch_size: 8, depth: 2, num_heads: 2}",
                    f"output_dir={out}", check=False)  # 32 px / 8 = 4 x 4 patches
    assert proc.returncode == 2 and "masking" in proc.stderr and "min_context" in proc.stderr
    assert not out.exists()
    proc = run_main("config=ijepa", *small, "model.trunk_kwargs={patch_size: 16, depth: 2, num_heads: 2}",
                    f"output_dir={out}", check=False)  # 2 x 2: no target block fits
    assert proc.returncode == 2 and "too small for I-JEPA's blocks" in proc.stderr and not out.exists()


@pytest.mark.slow
def test_recipe_trains_with_the_linear_momentum(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_main("config=ijepa", *SMALL, *RECIPES["ijepa"], "optim.max_steps=3", "eval.knn.enabled=false",
             f"output_dir={out}")
    logged = (out / "metrics.jsonl").read_text()
    assert '"target_std"' in logged
    ckpt = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest.txt").read_text(), weights_only=False)
    assert any(k.startswith("teacher_trunk.") for k in ckpt["model"]) and "predictor.mask_token" in ckpt["model"]
    assert ckpt["hooks"]["momentum_teacher"]["last_momentum"] == pytest.approx(0.99 + 0.01 * 2 / 3, abs=1e-3)
