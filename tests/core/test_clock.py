"""The training clock: every schedule runs on optimizer updates, so accumulation K with batch B/K equals batch B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, metrics

from sslkit.clock import TrainClock
from sslkit.launch.cli import main

SCHEDULED = ("lr", "weight_decay", "teacher_momentum", "teacher_temp")


def test_clock_where_and_last_micro_batch() -> None:
    clock = TrainClock(step=3, max_steps=12, micro_batches=2)
    assert clock.where == 0.25 and not clock.last_micro_batch
    clock.micro_batch = 1
    assert clock.last_micro_batch
    clock.step = 12
    assert clock.where < 1.0  # schedules are defined on [0, 1)


def test_every_loss_is_called_one_way_with_the_step_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """loss(output, sample, ctx) for every loss: sslkit's own all take the context, and a user's loss whose forward
    cannot is a config error naming the fix, from validation (not a TypeError at the first step)."""
    import inspect

    import sslkit.methods  # noqa: F401  (registrations)
    from sslkit import registry as R
    from sslkit.config.compose import compose_config
    from sslkit.config.schema import ConfigError

    for name, loss in R.LOSSES:
        assert list(inspect.signature(loss.forward).parameters)[1:4] == ["output", "sample", "ctx"], name

    class TwoArguments(torch.nn.Module):
        def forward(self, output, sample):
            return output

    monkeypatch.setitem(R.LOSSES._obj_map, "two_arguments", TwoArguments)  # registered for this test only
    with pytest.raises(ConfigError, match=r"'loss.name' = two_arguments: TwoArguments.forward takes \(output, "
                                          r"sample\), but sslkit calls every loss as loss\(output, sample, ctx\).*"
                                          r"add a third argument, ctx=None"):
        compose_config(["config=simclr", "machine.device=cpu", "loss={name: two_arguments}"])


def _schedules(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, *overrides: str) -> list[dict]:
    out = tmp_path / name
    args = ["config=dino", *SMALL, *RECIPES["dino"], "optim.epochs=2", "log.every_n_steps=1", "eval.knn.enabled=false",
            "log.tensorboard=false", "loss.warmup_teacher_temp_steps=5", f"output_dir={out}", *overrides]
    assert main(args) == 0
    capsys.readouterr()
    return [r for r in metrics(out) if r.get("phase") == "train" and "teacher_temp" in r]


def test_accumulation_sees_every_schedule_at_the_value_of_the_whole_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DINO, 8 updates: batch 16 against 2 micro-batches of 8. Per logged update, lr, weight decay, teacher
    momentum and teacher temperature are the same numbers; the temperature climbs 0.04 -> 0.07 over 5 updates
    in both (it ran twice as fast under accumulation when the loss counted its own calls)."""
    whole = _schedules(tmp_path, capsys, "whole", "data.batch_size=16")
    accumulated = _schedules(tmp_path, capsys, "accumulated", "data.batch_size=8", "optim.micro_batches=2")
    assert [r["step"] for r in whole] == [r["step"] for r in accumulated] == list(range(1, 9))
    for a, b in zip(whole, accumulated, strict=True):
        assert {k: a[k] for k in SCHEDULED} == {k: b[k] for k in SCHEDULED}
    temps = [r["teacher_temp"] for r in whole]
    assert temps == pytest.approx([0.04 + 0.03 * min(u, 5) / 5 for u in range(8)])
    assert whole[0]["weight_decay"] == pytest.approx(0.04) and whole[-1]["weight_decay"] > whole[0]["weight_decay"]
    assert whole[-1]["teacher_momentum"] > whole[0]["teacher_momentum"]  # cosine 0.996 -> 1
