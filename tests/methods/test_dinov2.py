"""DINOv2's loss: iBOT's terms plus KoLeo, and Sinkhorn-Knopp teachers in place of the centres."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, distillation_output, run_main

from sslkit.methods.dinov2 import DINOv2Loss
from sslkit.methods.dinov2_parts import koleo_loss, masked_patch_loss
from sslkit.methods.ibot import IBOTLoss
from sslkit.methods.sinkhorn import sinkhorn_knopp


def _output(seed: int) -> dict:
    return distillation_output(seed, b=4, m=3, k=6, masked=0.6)


def test_with_centring_it_is_ibot_plus_koleo_on_each_global_crop() -> None:
    out = _output(0)
    ibot = IBOTLoss(out_dim=6, teacher_temp=0.05, teacher_patch_temp=0.05, warmup_teacher_temp=0.05,
                    warmup_teacher_patch_temp=0.05).eval()
    dinov2 = DINOv2Loss(out_dim=6, teacher_temp=0.05, warmup_teacher_temp=0.05, koleo_weight=0.3).eval()
    koleo = koleo_loss(out["features"][0]) + koleo_loss(out["features"][1])  # the local crops' are left out
    got = dinov2(out, {})
    assert got["koleo_loss"].item() == pytest.approx(koleo.item(), rel=1e-6)
    assert got["loss"].item() == pytest.approx(ibot(out, {})["loss"].item() + 0.3 * koleo.item(), rel=1e-6)


def test_sinkhorn_knopp_teachers_and_no_centre() -> None:
    out = _output(1)
    loss = DINOv2Loss(out_dim=6, teacher_temp=0.05, warmup_teacher_temp=0.05, centering="sinkhorn_knopp",
                      koleo_weight=0.0).train()
    with torch.enable_grad():
        got = loss(out, {})
    # the CLS teacher: Sinkhorn-Knopp over both global crops' rows together
    probs = sinkhorn_knopp(torch.cat(out["targets"]), 0.05, 3).view(2, 4, 6)
    log_s = [torch.log_softmax(p / 0.1, -1) for p in out["projections"]]
    pairs = [-(probs[i] * log_s[v]).sum(-1).mean() for i in range(2) for v in range(4) if v != i]
    cls = torch.stack(pairs).mean()
    # the patch teacher: Sinkhorn-Knopp over the masked slots of both crops, padding left out
    t, w = torch.stack(out["patch_targets"]), torch.stack(out["patch_weights"])
    real = w.bool()
    rows = torch.zeros_like(t)
    rows[real] = sinkhorn_knopp(t[real], 0.05, 3)
    patch = torch.stack([masked_patch_loss(out["patch_projections"][v], rows[v], w[v]) for v in range(2)]).mean()
    assert got["cls_loss"].item() == pytest.approx(cls.item(), rel=1e-5)
    assert got["patch_loss"].item() == pytest.approx(patch.item(), rel=1e-5)
    assert loss.cls_center.value.abs().sum() == 0 and loss.patch_center.value.abs().sum() == 0


def _one_buffer(out: dict, seed: int) -> dict:
    """The same output with both global crops' slots in one shuffled buffer and each slot's image (``v x B + b``),
    as IBOTModel gives it."""
    t, s, w = (torch.stack(out[k]) for k in ("patch_targets", "patch_projections", "patch_weights"))  # [G, B, M, ...]
    g, b, m = w.shape
    order = torch.randperm(g * b * m, generator=torch.Generator().manual_seed(seed))
    image = torch.arange(g * b).repeat_interleave(m)
    return {**out, "patch_targets": [t.reshape(g * b * m, -1)[order]],
            "patch_projections": [s.reshape(g * b * m, -1)[order]], "patch_weights": [w.reshape(-1)[order]],
            "patch_images": [image[order]]}


@pytest.mark.parametrize("centering", ["centering", "sinkhorn_knopp"])
def test_the_losses_are_the_same_over_one_buffer_of_slots(centering: str) -> None:
    """IBOTModel gathers all global crops' masked patches into one buffer: iBOT's and DINOv2's losses, the logged
    entropies and the moved patch centre are those of the per-crop layout."""
    out = _output(2)
    for make in (lambda: IBOTLoss(out_dim=6).train(), lambda: DINOv2Loss(out_dim=6, centering=centering).train()):
        per_crop, pooled = make(), make()
        with torch.enable_grad():
            a, b = per_crop(out, {}), pooled(_one_buffer(out, 3), {})
        for key in ("loss", "patch_loss", "cls_loss", "teacher_patch_entropy"):
            assert b[key].item() == pytest.approx(a[key].item(), rel=1e-5), key
        torch.testing.assert_close(pooled.patch_center.value, per_crop.patch_center.value)


def test_bad_centering_is_refused() -> None:
    with pytest.raises(ValueError, match="centering"):
        DINOv2Loss(centering="sinkhorn")


@pytest.mark.slow
def test_recipe_trains_with_sinkhorn_knopp(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_main("config=dinov2", *SMALL, *RECIPES["dinov2"], "optim.max_steps=2", "eval.knn.enabled=false",
             f"output_dir={out}")
    logged = (out / "metrics.jsonl").read_text()
    assert '"koleo_loss"' in logged and '"patch_loss"' in logged


def test_sinkhorn_knopp_with_a_batch_too_small_for_its_prototypes_is_a_config_error(tmp_path: Path) -> None:
    from sslkit.config.compose import compose_config
    from sslkit.config.schema import ConfigError
    from sslkit.config.validate import validate

    base = ["config=dinov2", "machine.device=cpu", "data.batch_size=16", "model.head.out_dim=2048",
            "loss.centering=sinkhorn_knopp"]
    # 32 rows for 2048 prototypes: each row spreads over >= 64, entropy >= ln 64 > ln(2048) / 2
    with pytest.raises(ConfigError, match=r"16 x 1 process\(es\) x 2 global crops = 32 teacher rows for "
                                          r"loss.out_dim=2048 prototypes.*at least 64 prototypes.*to at least 23 here"
                                          r".*at most 1024.*loss.centering=centering"):
        validate(compose_config(base))
    validate(compose_config([*base, "loss.centering=centering"]))  # centring has no such limit
    validate(compose_config([*base, "data.batch_size=23"]))  # 46 rows: 46**2 = 2116 >= 2048
    validate(compose_config([*base, "model.head.out_dim=1024"]))  # DINOv2 itself runs 32 prototypes per row
