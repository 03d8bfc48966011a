"""iBOT: the masked-patch loss and its centre against computations written out here, the model's masking, a recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import SMALL, VIT, distillation_output, run_main

from sslkit.clock import StepContext, TrainClock
from sslkit.methods.dino import build_dino_head, dino_loss
from sslkit.methods.ibot import IBOTLoss, build_ibot
from sslkit.models.masking import BlockMasking, SampleKeys, batch_slots
from sslkit.models.vit import build_vit


def _patch_loss_by_loop(student: list[torch.Tensor], teacher: list[torch.Tensor], weights: list[torch.Tensor],
                        center: torch.Tensor, tau_s: float, tau_t: float) -> float:
    """Per view, per image: the mean over masked slots of -sum_k p_t log p_s, p_t = softmax((t - c) / tau_t);
    the mean over all images, then over views."""
    views = []
    for s, t, w in zip(student, teacher, weights):
        images = []
        for b in range(s.shape[0]):
            terms = []
            for m in range(s.shape[1]):
                if not w[b, m]:
                    continue
                tl = [(t[b, m, k].item() - center[0, k].item()) / tau_t for k in range(s.shape[2])]
                zt = sum(math.exp(x - max(tl)) for x in tl)
                sl = [s[b, m, k].item() / tau_s for k in range(s.shape[2])]
                log_zs = max(sl) + math.log(sum(math.exp(x - max(sl)) for x in sl))
                terms.append(-sum(math.exp(tl[k] - max(tl)) / zt * (sl[k] - log_zs) for k in range(s.shape[2])))
            images.append(sum(terms) / len(terms) if terms else 0.0)
        views.append(sum(images) / len(images))
    return sum(views) / len(views)


def _output(seed: int) -> dict:
    return distillation_output(seed, b=3, m=4, k=5, masked=0.5)


def test_loss_is_dino_on_cls_plus_the_masked_patch_loss_written_out() -> None:
    out = _output(0)
    loss = IBOTLoss(out_dim=5, teacher_temp=0.04, teacher_patch_temp=0.07, lambda_cls=0.5, lambda_patch=2.0).eval()
    center = torch.randn(1, 5)
    loss.patch_center.value.copy_(center)
    got = loss(out, {})
    patch = _patch_loss_by_loop(out["patch_projections"], out["patch_targets"], out["patch_weights"], center,
                                0.1, 0.07)
    cls = dino_loss(out["projections"], out["targets"], torch.zeros(1, 5), 0.1, 0.04).item()
    assert got["patch_loss"].item() == pytest.approx(patch, rel=1e-5)
    assert got["loss"].item() == pytest.approx(0.5 * cls + 2.0 * patch, rel=1e-5)


def test_patch_centre_is_the_ema_of_the_masked_teacher_logits_once_per_update() -> None:
    out = _output(1)
    loss = IBOTLoss(out_dim=5).train()
    clock = TrainClock(micro_batches=2)
    t, w = out["patch_targets"], out["patch_weights"]
    with torch.enable_grad():
        loss(out, {}, StepContext(clock, True, torch.device("cpu")))  # first micro-batch: nothing moves yet
        assert loss.patch_center.value.abs().sum() == 0
        clock.micro_batch = 1
        loss(out, {}, StepContext(clock, True, torch.device("cpu")))
    mean = 2 * sum((ti * wi[..., None]).sum((0, 1)) for ti, wi in zip(t, w)) / (2 * sum(wi.sum() for wi in w))
    torch.testing.assert_close(loss.patch_center.value[0], 0.1 * mean)
    before = loss.patch_center.value.clone()
    none = {**out, "patch_weights": [torch.zeros_like(wi) for wi in w]}
    with torch.enable_grad():
        loss(none, {})  # an update without a masked patch leaves the centre
    assert torch.equal(loss.patch_center.value, before)


def test_patch_temperature_warms_up_on_the_clock() -> None:
    loss = IBOTLoss(out_dim=5, warmup_teacher_patch_temp=0.04, teacher_patch_temp=0.07, warmup_teacher_temp_steps=10)
    assert loss.teacher_patch_temp.at(TrainClock(step=0)) == pytest.approx(0.04)
    assert loss.teacher_patch_temp.at(TrainClock(step=5)) == pytest.approx(0.055)
    assert loss.teacher_patch_temp.at(TrainClock(step=10)) == pytest.approx(0.07)


def _model(separate: bool = False):
    torch.manual_seed(0)
    trunk = build_vit("vit_tiny", in_channels=1, img_size=16, patch_size=4, depth=2, num_heads=2)
    head = build_dino_head(trunk.out_dim, out_dim=7, hidden_dim=16, bottleneck_dim=8)
    return build_ibot(trunk, head, separate_patch_head=separate, patch_out_dim=9 if separate else None).eval()


def test_the_student_sees_mask_tokens_the_teacher_the_whole_image() -> None:
    model = _model()
    views = [torch.randn(6, 1, 16, 16) for _ in range(2)] + [torch.randn(6, 1, 8, 8)]
    gen = BlockMasking(probability=0.5, ratio_min=0.2, ratio_max=0.5, min_patches=2)
    masks = [gen(SampleKeys(0, 0, torch.arange(6), v), (4, 4)) for v in range(2)]
    out = model(views, masks)
    assert len(out["projections"]) == 3 and len(out["targets"]) == 2
    # every masked patch of the 12 global crops in one buffer of S places, in (crop, image, patch) order
    s = batch_slots(masks[0], 12)
    assert s <= 12 * gen.max_masked(16)
    assert out["patch_projections"][0].shape == (s, 7) and out["patch_weights"][0].shape == (s,)
    flat = torch.cat([m.mask for m in masks]).flatten()
    places = flat.nonzero()[:, 0]
    assert int(flat.sum()) <= s
    w = out["patch_weights"][0].bool()
    assert int(w.sum()) == len(places) and torch.equal(out["patch_images"][0][w], places // 16)
    with torch.no_grad():  # the teacher's patch logits at the masked places, computed here from its whole crops
        teacher = model.teacher_trunk.forward_tokens(torch.cat(views[:2])).patches.flatten(0, 1)
        torch.testing.assert_close(out["patch_targets"][0][w], model.teacher_head(teacher[places]))
    # the student saw the mask token at those places, the teacher the patch
    assert not torch.allclose(out["patch_projections"][0][w], out["patch_targets"][0][w])
    for v in range(2):
        whole = masks[v].mask.sum(1) == 0  # images without a masked patch: student = teacher at the start
        hidden = ~whole
        assert whole.any() and hidden.any()
        torch.testing.assert_close(out["projections"][v][whole], out["targets"][v][whole])
        assert not torch.allclose(out["projections"][v][hidden], out["targets"][v][hidden])
    loss = IBOTLoss(out_dim=7)(out, {})["loss"]
    loss.backward()
    assert model.trunk.mask_token.grad is not None and model.trunk.mask_token.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.teacher_trunk.parameters())


def test_a_separate_patch_head_has_its_own_size_and_teacher() -> None:
    model = _model(separate=True)
    views = [torch.randn(2, 1, 16, 16) for _ in range(2)]
    gen = BlockMasking(probability=1.0, ratio_min=0.2, ratio_max=0.4, min_patches=2)
    out = model(views, [gen(SampleKeys(0, 0, torch.arange(2), v), (4, 4)) for v in range(2)])
    assert out["patch_projections"][0].shape[-1] == 9 and out["projections"][0].shape[-1] == 7
    assert (model.patch_head, model.teacher_patch_head) in model.momentum_pairs()
    with pytest.raises(ValueError, match="separate_patch_head"):
        build_ibot(model.trunk, model.head, patch_out_dim=9)


@pytest.mark.slow
def test_recipe_trains_and_checkpoints_both_centres(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_main("config=ibot", *SMALL, *VIT, "data.transform.num_small=2", "data.small_image_size=16",
             "model.head.bottleneck_dim=8", "optim.max_steps=3", "eval.knn.enabled=false", f"output_dir={out}")
    ckpt = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest.txt").read_text(), weights_only=False)
    assert ckpt["loss"]["patch_center.value"].abs().sum() > 0 and ckpt["loss"]["cls_center.value"].abs().sum() > 0
    assert "trunk.mask_token" in ckpt["model"] and "teacher_trunk.mask_token" in ckpt["model"]
    logged = (out / "metrics.jsonl").read_text()
    assert '"patch_loss"' in logged and '"teacher_patch_entropy"' in logged


def test_the_dino_family_refuses_a_temperature_that_is_not_positive() -> None:
    """The CLS temperatures are checked in one place (dino_temperatures) for DINO, iBOT and DINOv2, the patch
    temperatures by iBOT, each with its message."""
    from sslkit.methods.dino import DINOLoss

    for bad in ({"student_temp": 0.0}, {"teacher_temp": -0.1}, {"warmup_teacher_temp": 0.0}):
        for loss in (DINOLoss, IBOTLoss):
            with pytest.raises(ValueError, match=r"^dino temperatures must be > 0$"):
                loss(out_dim=5, **bad)
    for bad in ({"teacher_patch_temp": 0.0}, {"warmup_teacher_patch_temp": -1.0}):
        with pytest.raises(ValueError, match=r"^ibot patch temperatures must be > 0$"):
            IBOTLoss(out_dim=5, **bad)
