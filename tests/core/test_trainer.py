"""The trainer fires VISSL's ten events in order, skips backward/update in eval phases, and re-raises."""

from __future__ import annotations

import pytest
import torch
from helpers import make_task

from sslkit.checkpoint import Checkpointer
from sslkit.hooks.base import Event, Slot, SSLHook
from sslkit.task import Phase, SSLTask
from sslkit.train_steps.standard import standard_train_step
from sslkit.trainer import train


class Recorder(SSLHook):
    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple[str, bool]] = []

    def __getattribute__(self, item: str):  # record every on_* call with the phase kind
        if item.startswith("on_"):
            def record(task: SSLTask) -> None:
                self.events.append((item, task.train))
            return record
        return super().__getattribute__(item)


def test_event_order_one_train_phase() -> None:
    rec = Recorder()
    task = make_task([Phase(train=True, epoch=0)], [rec])
    train(task, standard_train_step)
    step = ["on_forward", "on_loss_and_meter", "on_backward", "on_update", "on_step"]
    expected = ["on_start", "on_phase_start", *step, *step, "on_phase_end", "on_end"]
    assert [e for e, _ in rec.events] == expected
    assert task.clock.step == 2


def test_eval_phase_fires_no_backward_and_does_not_update() -> None:
    rec = Recorder()
    task = make_task([Phase(train=True, epoch=0), Phase(train=False, epoch=0, split="test")], [rec])
    train(task, standard_train_step)
    eval_events = [e for e, is_train in rec.events if not is_train and e not in ("on_end",)]
    assert "on_backward" not in eval_events and "on_update" not in eval_events
    assert eval_events.count("on_forward") == 2
    assert task.clock.step == 2  # eval steps are not optimizer steps


def test_eval_phase_leaves_weights_unchanged() -> None:
    task = make_task([Phase(train=False, epoch=0, split="test")], [])
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    train(task, standard_train_step)
    for k, v in task.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_max_updates_stops_mid_epoch_and_skips_remaining_epochs() -> None:
    task = make_task([Phase(train=True, epoch=e) for e in range(3)], [])
    task.clock.max_steps = 3
    train(task, standard_train_step)
    assert task.clock.step == 3
    # 2 steps per epoch: epoch 1 was cut after its first step and stays the current phase, so that a run
    # lengthened later goes on from there; epoch 2 never started
    assert (task.phase_idx, task.clock.step_in_epoch, task.phase_done) == (1, 1, False)
    state = Checkpointer.state(task)["position"]
    assert (state["phase_idx"], state["step_in_epoch"]) == (1, 1)
    assert not task.done_training


class Boom(SSLHook):
    def on_update(self, task: SSLTask) -> None:
        raise RuntimeError("boom at update")


def test_exception_fires_on_exception_then_reraises() -> None:
    rec = Recorder()
    task = make_task([Phase(train=True, epoch=0)], [rec, Boom()])
    with pytest.raises(RuntimeError, match="boom at update"):
        train(task, standard_train_step)
    names = [e for e, _ in rec.events]
    assert names[-1] == "on_exception"
    assert "on_end" not in names and "on_step" not in names
    assert isinstance(task.exception, RuntimeError)


def test_hook_slots_order_hooks_and_keep_the_given_order_within_a_slot() -> None:
    calls: list[str] = []

    class A(SSLHook):
        slot = Slot.LOG

        def on_start(self, task: SSLTask) -> None:
            calls.append("A")

    class B(SSLHook):
        slot = Slot.MONITOR

        def on_start(self, task: SSLTask) -> None:
            calls.append("B")

    class C(SSLHook):  # Slot.METHOD, the default
        def on_start(self, task: SSLTask) -> None:
            calls.append("C")

    class D(SSLHook):
        slot = Slot.MONITOR

        def on_start(self, task: SSLTask) -> None:
            calls.append("D")

    task = make_task([Phase(train=True, epoch=0)], [A(), D(), B(), C()])
    task.run_hooks(Event.ON_START)
    assert calls == ["C", "D", "B", "A"]


def test_sgd_step_matches_hand_update() -> None:
    task = make_task([Phase(train=True, epoch=0)], [], n=3, batch=3)
    w0 = task.model.lin.weight.detach().clone()
    b0 = task.model.lin.bias.detach().clone()
    x = torch.stack([d["input"][0] for d in task.loaders["train"].dataset])
    w = w0.clone().requires_grad_()
    b = b0.clone().requires_grad_()
    (x @ w.T + b).pow(2).mean().backward()
    train(task, standard_train_step)
    assert torch.allclose(task.model.lin.weight, w0 - 0.1 * w.grad, atol=1e-7)
    assert torch.allclose(task.model.lin.bias, b0 - 0.1 * b.grad, atol=1e-7)
