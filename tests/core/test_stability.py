"""Stability warnings: each known failure mode recognised from real loss outputs and logged once with its fix."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import RECIPES, SMALL, run_main

from sslkit.clock import TrainClock
from sslkit.guard import NonFiniteLossError, UpdateGuard
from sslkit.methods.dino import DINOLoss
from sslkit.methods.dinov2 import DINOv2Loss
from sslkit.stability import StabilityWatch, diagnose, fp16_temperature_warning, prototypes


def _dinov2_output(features: list[torch.Tensor], k: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    b = features[0].shape[0]
    return {"features": features, "projections": [torch.randn(b, k, generator=g) for _ in range(2)],
            "targets": [torch.randn(b, k, generator=g) for _ in range(2)],
            "patch_projections": [torch.randn(b, 3, k, generator=g) for _ in range(2)],
            "patch_targets": [torch.randn(b, 3, k, generator=g) for _ in range(2)],
            "patch_weights": [torch.ones(b, 3) for _ in range(2)]}


def test_duplicate_images_are_named_as_koleos_failure() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=g)
    loss = DINOv2Loss(out_dim=8).eval()
    clean = loss(_dinov2_output([x, x + 0.1]), {})
    assert clean["koleo_min_distance"].item() > 0.1
    assert "koleo_duplicates" not in diagnose({k: v.item() for k, v in clean.items()}, 8, 0.5, True)
    dup = x.clone()
    dup[3] = dup[1]  # the same image twice in the batch: the same embedding
    out = loss(_dinov2_output([dup, x]), {})
    # the two duplicates each add -log(eps + ~0) / 6, about 16.8 / 6, where distances near 1 add about 0
    assert out["koleo_min_distance"].item() < 1e-3
    assert out["koleo_loss"].item() > clean["koleo_loss"].item() + 2 * 15.0 / 6
    found = diagnose({k: v.item() for k, v in out.items()}, 8, 0.5, True)
    assert "duplicate images" in found["koleo_duplicates"] and "loss.koleo_weight" in found["koleo_duplicates"]


def test_uniform_and_one_hot_teachers_and_the_loss_at_ln_k() -> None:
    k = 64
    ln_k = math.log(k)
    # a teacher much hotter than its logits' spread: the DINO loss itself gives ln K and a uniform teacher
    loss = DINOLoss(out_dim=k, teacher_temp=100.0, warmup_teacher_temp=100.0, student_temp=100.0)
    g = torch.Generator().manual_seed(2)
    out = loss({"projections": [torch.randn(8, k, generator=g) for _ in range(4)],
                "targets": [torch.randn(8, k, generator=g) for _ in range(2)]}, {})
    record = {"loss": out["loss"].item(), "teacher_entropy": out["teacher_entropy"].item(), "teacher_temp": 100.0}
    assert record["teacher_entropy"] == pytest.approx(ln_k, rel=1e-3) and record["loss"] == pytest.approx(ln_k, 1e-3)
    found = diagnose(record, k, 0.5, settled=True)
    assert set(found) == {"loss_at_log_k", "hot_teacher"}
    assert "loss.teacher_temp (now 100)" in found["hot_teacher"] and "ln K = ln 64" in found["loss_at_log_k"]
    assert diagnose(record, k, 0.01, settled=False) == {}  # a DINO teacher starts near uniform: not before it settles
    assert diagnose(record, None, 0.5, settled=True) == {}  # not a DINO-family loss
    cold = DINOLoss(out_dim=k, teacher_temp=1e-3, warmup_teacher_temp=1e-3)
    out = cold({"projections": [torch.randn(8, k, generator=g) for _ in range(2)],
                "targets": [torch.randn(8, k, generator=g) * 10 for _ in range(2)]}, {})
    found = diagnose({"loss": out["loss"].item(), "teacher_entropy": out["teacher_entropy"].item()}, k, 0.5, True)
    assert set(found) == {"one_hot_teacher"} and "Raise loss.teacher_temp" in found["one_hot_teacher"]
    assert set(diagnose({"loss": 1.0, "embedding_std_ratio": 0.01}, None, 0.5, True)) == {"collapsed_embeddings"}


def test_float16_with_low_temperatures_is_named_at_the_start_and_in_the_guards_halt() -> None:
    loss = DINOLoss(out_dim=16, teacher_temp=0.04, warmup_teacher_temp=0.04)
    assert prototypes(loss) == 16
    message = fp16_temperature_warning(loss, torch.float16)
    assert message is not None and "loss.teacher_temp=0.04" in message and "amp.dtype=bfloat16" in message
    assert fp16_temperature_warning(loss, torch.bfloat16) is None and fp16_temperature_warning(loss, None) is None
    assert fp16_temperature_warning(DINOLoss(out_dim=16, teacher_temp=0.2, warmup_teacher_temp=0.2,
                                             student_temp=0.2), torch.float16) is None
    task = SimpleNamespace(loss=loss, amp_dtype=torch.float16, clock=TrainClock(max_steps=10))
    watch = StabilityWatch()
    assert watch.start(task) == [message] and watch.start(task) == []  # once
    guard = UpdateGuard(nonfinite="halt")
    guard.report_loss(task, torch.tensor(float("nan")), {}, {})
    with pytest.raises(NonFiniteLossError, match=r"A likely cause: amp\.dtype=float16 with loss\.teacher_temp=0\.04"):
        guard.check(task)


def test_a_too_hot_teacher_is_warned_once_in_the_log_and_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_main("config=dino", *SMALL, *RECIPES["dino"], "loss.teacher_temp=50.0", "loss.warmup_teacher_temp=50.0",
                    "loss.warmup_teacher_temp_steps=0", "optim.max_steps=8", "log.every_n_steps=2",
                    "eval.knn.enabled=false", "log.report=true", f"output_dir={out}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    warnings = [r for r in rows if "warning" in r]
    assert [w["warning"] for w in warnings].count("hot_teacher") == 1
    assert warnings[0]["phase"] == "warning" and warnings[0]["step"] % 2 == 0
    assert "too-hot teacher" in proc.stdout + proc.stderr and "loss.teacher_temp (now 50)" in proc.stdout + proc.stderr
    report = (out / "report.md").read_text()
    assert "stability warning `hot_teacher`" in report
