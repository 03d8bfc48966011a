"""The training clock: every schedule runs on optimizer updates, so accumulation K with batch B/K equals batch B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, metrics

from sslkit.clock import StepContext, TrainClock, call_loss
from sslkit.launch.cli import main

SCHEDULED = ("lr", "weight_decay", "teacher_momentum", "teacher_temp")


def test_clock_where_and_last_micro_batch() -> None:
    clock = TrainClock(update=3, max_updates=12, micro_batches=2)
    assert clock.where == 0.25 and not clock.last_micro_batch
    clock.micro_batch = 1
    assert clock.last_micro_batch
    clock.update = 12
    assert clock.where < 1.0  # schedules are defined on [0, 1)


def test_call_loss_passes_the_context_only_to_losses_that_take_it() -> None:
    ctx = StepContext(TrainClock(update=7), True, torch.device("cpu"))

    def plain(output, sample):
        return output

    def scheduled(output, sample, ctx):
        return ctx.clock.update

    class Module(torch.nn.Module):
        def forward(self, output, sample, ctx=None):
            return ctx

    assert call_loss(plain, 1, {}, ctx) == 1
    assert call_loss(scheduled, 1, {}, ctx) == 7
    assert call_loss(Module(), 1, {}, ctx) is ctx


def _schedules(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, *overrides: str) -> list[dict]:
    out = tmp_path / name
    args = ["config=dino", *SMALL, *RECIPES["dino"], "optim.epochs=2", "log.every_n_steps=1", "eval.knn.enabled=false",
            "log.tensorboard=false", "loss.warmup_teacher_temp_iters=5", f"output_dir={out}", *overrides]
    assert main(args) == 0
    capsys.readouterr()
    return [r for r in metrics(out) if r.get("phase") == "train" and "teacher_temp" in r]


def test_accumulation_sees_every_schedule_at_the_value_of_the_whole_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DINO, 8 updates: batch 16 against 2 micro-batches of 8. Per logged update, lr, weight decay, teacher
    momentum and teacher temperature are the same numbers; the temperature climbs 0.04 -> 0.07 over 5 updates
    in both (it ran twice as fast under accumulation when the loss counted its own calls)."""
    whole = _schedules(tmp_path, capsys, "whole", "data.batch_size=16")
    accumulated = _schedules(tmp_path, capsys, "accumulated", "data.batch_size=8", "optim.accumulate_steps=2")
    assert [r["step"] for r in whole] == [r["step"] for r in accumulated] == list(range(1, 9))
    for a, b in zip(whole, accumulated, strict=True):
        assert {k: a[k] for k in SCHEDULED} == {k: b[k] for k in SCHEDULED}
    temps = [r["teacher_temp"] for r in whole]
    assert temps == pytest.approx([0.04 + 0.03 * min(u, 5) / 5 for u in range(8)])
    assert whole[0]["weight_decay"] == pytest.approx(0.04) and whole[-1]["weight_decay"] > whole[0]["weight_decay"]
    assert whole[-1]["teacher_momentum"] > whole[0]["teacher_momentum"]  # cosine 0.996 -> 1
