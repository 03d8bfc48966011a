"""machine.compile: every recipe's trunks and heads go through torch.compile, train to the eager losses, and keep
their checkpoint keys."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from helpers import RECIPES, SMALL, metrics, run_main
from torch._dynamo.utils import counters

COMPILED = ["machine.compile=true", "eval.knn.enabled=false", "log.tensorboard=false", "log.every_n_steps=1",
            "optim.max_steps=3"]


def _losses(out) -> list[float]:
    return [r["loss"] for r in metrics(out) if r.get("phase") == "train" and "loss" in r]


def _run(recipe: str, out, *args: str):
    torch._dynamo.reset()
    counters.clear()
    proc = run_main(*SMALL, f"config={recipe}", *RECIPES[recipe], *COMPILED, *args, f"output_dir={out}", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


#: Every CNN recipe, and the ViT paths: MAE's masked tokens (keep indices into the compiled forward), the pooled
#: forward of simclr_vit, iBOT's mask token, I-JEPA's padded context (an attention mask in every block). dino_vit,
#: mocov3_vit, lejepa, dinov2 (ibot's model) and dinov3 (ibot's model on the DINOv3 trunk, whose compiled forward
#: tests/models/test_rope_vit.py checks against the eager one) compile the same ViT forwards (20-25 s each here
#: with aot_eager): left out for the suite's time budget.
COMPILED_RECIPES = [r for r in RECIPES if r not in ("dino_vit", "mocov3_vit", "lejepa", "dinov2", "dinov3")]


@pytest.mark.parametrize("recipe", COMPILED_RECIPES)
def test_every_recipe_compiles_and_trains_to_the_eager_losses(tmp_path, recipe: str) -> None:
    """aot_eager (dynamo's graph capture and AOT autograd, kernels run eagerly: fast to check): graphs are
    captured for the trunks and heads, and the 3 logged losses are finite; for a plain and a teacher recipe
    they are the uncompiled run's to float rounding."""
    proc = _run(recipe, tmp_path / "compiled", "machine.compile_backend=aot_eager")
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # at least the trunk and a head
    assert "module(s) compiled with torch.compile" in proc.stdout
    got = _losses(tmp_path / "compiled")
    assert len(got) == 3 and all(math.isfinite(v) for v in got)
    if recipe in ("simclr", "byol"):
        run_main(*SMALL, f"config={recipe}", *RECIPES[recipe], *COMPILED[1:], f"output_dir={tmp_path / 'eager'}")
        assert got == pytest.approx(_losses(tmp_path / "eager"), rel=1e-4, abs=1e-5)


def test_a_compiled_dinov3_follows_a_high_resolution_phase(tmp_path) -> None:
    """A phase from update 1 changes the crops' sizes between updates (32 px, then 40 or 48 px, the Gram teacher's
    48 px crops then 64 or 72 px): dynamo captures the new shapes instead of failing on them, and the compiled run's
    losses are finite and follow the eager run's (measured: within 0.04 over 6 updates, the teacher's sharpening
    amplifying float rounding; 2e-3 relative is asserted on the first update, before any size change)."""
    from sslkit.data.resolution import HighResPhase

    hires = ["hires.start_step=1", "hires.global_sizes=[40,48]", "hires.local_sizes=[16,24]",
             "hires.teacher_sizes=[64,72]", "hires.ratios=[0.5,0.5]", "gram.teacher_size=48"]
    proc = _run("dinov3", tmp_path / "compiled", "machine.compile_backend=aot_eager", *hires)
    assert "module(s) compiled with torch.compile" in proc.stdout
    rows = [r for r in metrics(tmp_path / "compiled") if r.get("phase") == "train" and "loss" in r]
    phase = HighResPhase(1, (40, 48), (16, 24), (64, 72), (0.5, 0.5), seed=0)
    assert [r["crop_size"] for r in rows] == [32] + [phase.sizes(phase.choice(u))[0] for u in (1, 2)]
    assert len({r["crop_size"] for r in rows}) >= 2 and all(math.isfinite(r["loss"]) for r in rows)
    run_main(*SMALL, "config=dinov3", *RECIPES["dinov3"], *COMPILED[1:], *hires, f"output_dir={tmp_path / 'eager'}")
    assert rows[0]["loss"] == pytest.approx(_losses(tmp_path / "eager")[0], rel=2e-3)


def test_checkpoints_of_a_compiled_model_keep_their_keys(tmp_path) -> None:
    """Compiled in place, the model's checkpoint has the eager model's parameter names (no ``_orig_mod.``), so a
    compiled run resumes an eager one's checkpoint and the other way round. (Inductor's code generation is
    checked on the augmentation below and, for every recipe, by the GPU tests.)"""
    _run("simclr", tmp_path / "compiled", "machine.compile_backend=aot_eager")
    run_main(*SMALL, "config=simclr", *COMPILED[1:], f"output_dir={tmp_path / 'eager'}")
    keys = [sorted(torch.load(next((tmp_path / out / "checkpoints").glob("checkpoint_*.pt")), weights_only=False)
                   ["model"]) for out in ("compiled", "eager")]
    assert keys[0] == keys[1] and not any("_orig_mod" in k for k in keys[0])


def test_an_unknown_backend_or_mode_is_a_config_error(tmp_path) -> None:
    proc = run_main(*SMALL, "config=simclr", "machine.compile=true", "machine.compile_backend=inductr",
                    "machine.compile_mode=fast", f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "machine.compile_backend" in proc.stderr and "machine.compile_mode" in proc.stderr


def test_the_device_augmentation_compiles_to_the_eager_pixels() -> None:
    """machine.compile with data.augment_on=device also compiles the pixel operations (inductor, CPU kernels):
    the same views to float rounding, for RGB SimCLR views and multi-crop groups."""
    from sslkit.data.device_augment import device_augment_for
    from sslkit.data.transforms import build_multicrop

    torch._dynamo.reset()
    images = torch.randint(0, 256, (16, 3, 40, 40), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    eager = device_augment_for(build_multicrop(32, 16, num_small=2, blur_p=0.5, solarize_p=0.2))
    expected = eager(images, torch.Generator().manual_seed(1))
    eager.compile()
    got = eager(images, torch.Generator().manual_seed(1))
    assert all(g.shape == e.shape for g, e in zip(got, expected, strict=True))
    assert max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True)) < 1e-4


def test_a_run_compiles_its_device_augmentation(tmp_path) -> None:
    _run("simclr", tmp_path / "run", "machine.compile_backend=aot_eager", "data.augment_on=device")
    assert counters["stats"]["unique_graphs"] >= 3, dict(counters["stats"])  # trunk, head and the augmentation
    assert all(math.isfinite(v) for v in _losses(tmp_path / "run"))
