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



def test_the_stages_pass_the_micro_batch_and_never_read_it_back_from_the_task() -> None:
    """A body that changes the loss it was handed trains on that loss, whatever ``task.last_batch`` (the hooks'
    view) holds meanwhile; a body must return its micro-batch, and one that does not is told how."""
    from sslkit.task import MicroBatch
    from sslkit.train_steps import stages

    def zeroed(task: SSLTask) -> MicroBatch:
        batch = stages.forward_and_loss(task, stages.read_sample(task))
        assert task.last_batch is batch  # published for the hooks
        task.last_batch = MicroBatch(sample={}, loss=torch.ones((), requires_grad=True))  # a decoy: not read
        batch.loss = batch.loss * 0.0
        stages.reduce(task, batch)
        stages.backward(task, batch)
        return batch

    task = make_task([Phase(train=True, epoch=0)], [])
    w0 = task.model.lin.weight.detach().clone()
    train(task, lambda t: stages.update(t, stages.run_micro_batches(t, zeroed)))
    assert task.clock.step == 2 and torch.equal(task.model.lin.weight, w0)  # zero loss: zero gradient, no move
    assert float(task.loss_sum) == 0.0

    def forgetful(task: SSLTask) -> None:
        stages.forward_backward(task)

    task = make_task([Phase(train=True, epoch=0)], [])
    with pytest.raises(TypeError, match=r"a micro-batch body returns the MicroBatch that forward_and_loss made \(got "
                                        r"NoneType\): end it with 'return batch'"):
        train(task, lambda t: stages.update(t, stages.run_micro_batches(t, forgetful)))


def test_a_phase_chooses_its_samples_when_it_starts() -> None:
    """A train phase reads through a prefetcher opened by ``start_phase`` at the clock's position (the resume
    offset), an eval phase each batch as it comes, on the device; nothing is swapped in while the phase runs."""
    from sslkit.data.prefetch import Prefetcher
    from sslkit.train_steps import stages

    task = make_task([Phase(train=True, epoch=0), Phase(train=False, epoch=0)], [])
    task.start_phase()
    opened = task.data_iterator
    assert isinstance(opened, Prefetcher) and opened.position == 0
    stages.update(task, stages.run_micro_batches(task))
    assert task.data_iterator is opened and opened.position == 1
    task.clock.step_in_epoch = 1
    task.start_phase()  # as a resume into the phase's second step would
    assert isinstance(task.data_iterator, Prefetcher) and task.data_iterator.position == 1
    task.advance_phase()
    task.start_phase()
    assert not isinstance(task.data_iterator, Prefetcher)
    sample = stages.read_sample(task)
    assert isinstance(sample["input"], list) and sample["input"][0].device == task.device
