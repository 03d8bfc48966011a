"""The standard step: AMP (bf16 autocast, fp16 with a GradScaler), no host sync between log intervals."""

from __future__ import annotations

import pytest
import torch
from helpers import make_task

from sslkit.checkpoint import Checkpointer
from sslkit.hooks.base import SSLHook
from sslkit.hooks.logging import LogHook
from sslkit.task import Phase, SSLTask
from sslkit.train_steps.standard import standard_train_step
from sslkit.trainer import train


class DtypeProbe(SSLHook):
    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def on_forward(self, task: SSLTask) -> None:
        self.dtypes.append(task.last_batch.model_output["projections"][0].dtype)


def test_bf16_autocast_runs_forward_in_bf16_and_keeps_fp32_weights() -> None:
    probe = DtypeProbe()
    task = make_task([Phase(train=True, epoch=0)], [probe])
    task.amp_dtype = torch.bfloat16
    w0 = task.model.lin.weight.detach().clone()
    train(task, standard_train_step)
    assert probe.dtypes == [torch.bfloat16, torch.bfloat16]
    assert task.model.lin.weight.dtype == torch.float32
    assert not torch.equal(task.model.lin.weight, w0)


def test_fp16_uses_grad_scaler_and_checkpoints_it() -> None:
    task = make_task([Phase(train=True, epoch=0)], [])
    task.amp_dtype = torch.float16
    task.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    w0 = task.model.lin.weight.detach().clone()
    train(task, standard_train_step)
    assert torch.isfinite(task.model.lin.weight).all() and not torch.equal(task.model.lin.weight, w0)
    assert Checkpointer.state(task)["scaler"]["scale"] == pytest.approx(2.0**10)


def test_no_item_call_between_log_intervals(monkeypatch) -> None:
    in_step: list[int] = []
    in_hooks: list[int] = []
    state = {"stepping": False}
    task = make_task([Phase(train=True, epoch=0)], [], n=30, batch=3)  # 10 steps
    task.hooks.append(LogHook(every_n_steps=5))
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist")}

    def counting(name: str):
        def read(self):
            (in_step if state["stepping"] else in_hooks).append(task.clock.step)
            return originals[name](self)
        return read

    def step(t: SSLTask) -> None:
        state["stepping"] = True
        try:
            standard_train_step(t)
        finally:
            state["stepping"] = False

    for name in originals:  # the host reads of a tensor's values: each one a sync on CUDA
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    train(task, step)
    assert task.clock.step == 10
    assert in_step == []  # nothing inside the step (on_forward ... on_update included) syncs
    # the log hook reads its meter at iterations 5 and 10 only (and the DataLoader seeds itself at phase start)
    assert sorted(set(in_hooks) - {0}) == [5, 10]

