"""DINO: the loss against the paper's formula in loops, centre EMA, teacher temperature, head, model and hook."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from helpers import SMALL, run_main
from torch import nn
from torch.utils.data import DataLoader

from sslkit.clock import StepContext, TrainClock
from sslkit.hooks.base import Slot, SSLHook
from sslkit.methods.dino import (
    DINOLoss,
    FreezeLastLayerHook,
    build_dino,
    build_dino_head,
    dino_loss,
)
from sslkit.models.teacher import frozen_copy
from sslkit.optim.schedules import OnProgress, teacher_temp_at
from sslkit.task import DataPlan, Phase, SSLTask, Training
from sslkit.train_steps.standard import standard_train_step
from sslkit.trainer import train


def reference_dino(student: list[torch.Tensor], teacher: list[torch.Tensor], center: torch.Tensor,
                   tau_s: float, tau_t: float) -> float:
    """Eq. 3 of Caron et al. (2021) with centring: loops over (teacher crop, student crop) pairs and samples."""
    total, pairs = 0.0, 0
    c = center.double().flatten()
    for i, t in enumerate(teacher):
        for v, s in enumerate(student):
            if v == i:
                continue
            b, k = s.shape
            pair = 0.0
            for n in range(b):
                t_logits = [(float(t[n, j]) - float(c[j])) / tau_t for j in range(k)]
                mt = max(t_logits)
                zt = sum(math.exp(x - mt) for x in t_logits)
                p_t = [math.exp(x - mt) / zt for x in t_logits]
                s_logits = [float(s[n, j]) / tau_s for j in range(k)]
                ms = max(s_logits)
                log_zs = ms + math.log(sum(math.exp(x - ms) for x in s_logits))
                pair += -sum(p_t[j] * (s_logits[j] - log_zs) for j in range(k))
            total += pair / b
            pairs += 1
    return total / pairs


def logits(n: int, b: int, k: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, k, generator=g) for _ in range(n)]


# ----------------------------------------------------------------------------------------- loss
@pytest.mark.parametrize("tau_t", [0.04, 0.07])
def test_loss_matches_reference_loops(tau_t: float) -> None:
    student = logits(4, 5, 7, seed=0)  # 2 global + 2 local crops
    teacher = logits(2, 5, 7, seed=1)
    center = torch.randn(1, 7, generator=torch.Generator().manual_seed(2))
    got = dino_loss(student, teacher, center, 0.1, tau_t).item()
    assert got == pytest.approx(reference_dino(student, teacher, center, 0.1, tau_t), rel=1e-5)


def test_loss_module_matches_reference_and_logs_terms() -> None:
    student, teacher = logits(3, 4, 6, seed=3), logits(2, 4, 6, seed=4)
    loss = DINOLoss(out_dim=6, warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_steps=10)
    ctx = StepContext(clock=TrainClock(step=5), train=True, device=torch.device("cpu"))
    out = loss({"projections": student, "targets": teacher}, {}, ctx)
    # at update 5 of a 10-update warm-up the teacher temperature is halfway: 0.055
    expected = reference_dino(student, teacher, torch.zeros(1, 6), 0.1, 0.055)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
    assert ctx.scheduled == {"teacher_temp": pytest.approx(0.055)}
    assert 0.0 <= out["teacher_entropy"].item() <= math.log(6) + 1e-6


def test_loss_invariant_to_batch_permutation_and_global_view_swap() -> None:
    student, teacher = logits(4, 8, 5, seed=5), logits(2, 8, 5, seed=6)
    center = torch.randn(1, 5, generator=torch.Generator().manual_seed(7))
    base = dino_loss(student, teacher, center)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    permuted = dino_loss([s[perm] for s in student], [t[perm] for t in teacher], center)
    assert torch.allclose(permuted, base, atol=1e-6)
    swapped = dino_loss([student[1], student[0], *student[2:]], [teacher[1], teacher[0]], center)
    assert torch.allclose(swapped, base, atol=1e-6)


def test_no_gradient_into_teacher_and_centring_matters() -> None:
    student = [s.requires_grad_() for s in logits(2, 4, 5, seed=8)]
    teacher = [t.requires_grad_() for t in logits(2, 4, 5, seed=9)]
    dino_loss(student, teacher, torch.zeros(1, 5)).backward()
    assert all(t.grad is None for t in teacher) and all(s.grad is not None for s in student)
    # a centre equal for every prototype is a no-op; a non-uniform one changes the targets
    s, t = logits(2, 4, 5, seed=10), logits(2, 4, 5, seed=11)
    assert torch.allclose(dino_loss(s, t, torch.full((1, 5), 3.0)), dino_loss(s, t, torch.zeros(1, 5)), atol=1e-6)
    assert not torch.allclose(dino_loss(s, t, torch.arange(5.0).view(1, 5)), dino_loss(s, t, torch.zeros(1, 5)))


def test_center_follows_its_ema_exactly_over_two_steps() -> None:
    loss = DINOLoss(out_dim=5, center_momentum=0.9)
    t1, t2 = logits(2, 3, 5, seed=12), logits(2, 3, 5, seed=13)
    s = logits(3, 3, 5, seed=14)
    loss({"projections": s, "targets": t1}, {})
    c1 = 0.9 * torch.zeros(1, 5) + 0.1 * torch.cat(t1).mean(dim=0, keepdim=True)
    assert torch.allclose(loss.center.value, c1, atol=1e-7)
    # the second step's loss uses c1, then the centre moves to c2
    out = loss({"projections": s, "targets": t2}, {})
    assert out["loss"].item() == pytest.approx(reference_dino(s, t2, c1, 0.1, loss.teacher_temp.final), rel=1e-5)
    c2 = 0.9 * c1 + 0.1 * torch.cat(t2).mean(dim=0, keepdim=True)
    assert torch.allclose(loss.center.value, c2, atol=1e-7)
    # eval forwards (no grad) leave the state alone
    with torch.no_grad():
        loss({"projections": s, "targets": t1}, {})
    assert torch.allclose(loss.center.value, c2, atol=1e-7)
    # and the state round-trips through the state dict
    fresh = DINOLoss(out_dim=5)
    fresh.load_state_dict(loss.state_dict())
    assert torch.equal(fresh.center.value, loss.center.value)


def test_center_moves_once_per_update_over_the_micro_batches() -> None:
    """Accumulation: two micro-batches of 3 move the centre once, to the mean of all 6 samples' teacher
    outputs, as one batch of 6 does; the loss of both micro-batches uses the centre before the update."""
    t = logits(2, 6, 5, seed=20)
    s = logits(3, 6, 5, seed=21)
    whole = DINOLoss(out_dim=5, center_momentum=0.9)
    whole({"projections": s, "targets": t}, {}, StepContext(TrainClock(), True, torch.device("cpu")))
    split = DINOLoss(out_dim=5, center_momentum=0.9)
    clock = TrainClock(micro_batches=2)
    for micro, rows in enumerate((slice(0, 3), slice(3, 6))):
        clock.micro_batch = micro
        out = split({"projections": [x[rows] for x in s], "targets": [x[rows] for x in t]}, {},
                    StepContext(clock, True, torch.device("cpu")))
        assert out["loss"].item() == pytest.approx(
            reference_dino([x[rows] for x in s], [x[rows] for x in t], torch.zeros(1, 5), 0.1, 0.07), rel=1e-5)
        if micro == 0:
            assert torch.equal(split.center.value, torch.zeros(1, 5))  # not moved in the middle of an update
    expected = 0.1 * torch.cat(t).mean(dim=0, keepdim=True)
    assert torch.allclose(split.center.value, expected, atol=1e-7)
    assert torch.allclose(whole.center.value, expected, atol=1e-7)


def test_teacher_temperature_schedule() -> None:
    assert teacher_temp_at(0, 0.04, 0.07, 30) == pytest.approx(0.04)
    assert teacher_temp_at(15, 0.04, 0.07, 30) == pytest.approx(0.055)
    assert teacher_temp_at(29, 0.04, 0.07, 30) == pytest.approx(0.04 + 0.03 * 29 / 30)
    assert teacher_temp_at(30, 0.04, 0.07, 30) == pytest.approx(0.07)
    assert teacher_temp_at(1000, 0.04, 0.07, 30) == pytest.approx(0.07)
    assert teacher_temp_at(0, 0.04, 0.07, 0) == pytest.approx(0.07)  # no warmup
    loss = DINOLoss(out_dim=4, warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_steps=4)
    temps = []
    clock = TrainClock(micro_batches=2)
    for update in range(6):  # the temperature follows the clock's updates, not the calls (2 per update here)
        clock.step = update
        for micro in range(2):
            clock.micro_batch = micro
            ctx = StepContext(clock, True, torch.device("cpu"))
            loss({"projections": logits(2, 2, 4, update), "targets": logits(2, 2, 4, update + 50)}, {}, ctx)
            temps.append(ctx.scheduled["teacher_temp"])
    assert temps == pytest.approx([t for t in [0.04, 0.0475, 0.055, 0.0625, 0.07, 0.07] for _ in range(2)])


def test_loss_checks_out_dim() -> None:
    with pytest.raises(ValueError, match="out_dim"):
        DINOLoss(out_dim=9)({"projections": logits(2, 2, 4, 0), "targets": logits(2, 2, 4, 1)}, {})


# ----------------------------------------------------------------------------------------- head
def test_head_shape_and_weight_norm() -> None:
    torch.manual_seed(0)
    head = build_dino_head(in_dim=12, out_dim=20, hidden_dim=16, bottleneck_dim=8)
    out = head(torch.randn(5, 12))
    assert out.shape == (5, 20)
    w = head.last_layer.weight
    assert torch.allclose(w.norm(dim=1), torch.ones(20), atol=1e-6)  # g = 1: unit rows
    g, v = head.last_layer.parametrizations.weight.original0, head.last_layer.parametrizations.weight.original1
    assert not g.requires_grad and v.requires_grad
    with torch.no_grad():
        v.mul_(3.0)  # the scale of v does not matter
    assert torch.allclose(head.last_layer.weight.norm(dim=1), torch.ones(20), atol=1e-6)
    # outputs are cosine similarities of the normalised bottleneck with the unit rows: in [-1, 1]
    assert head(torch.randn(5, 12)).abs().max() <= 1.0 + 1e-6
    trainable = build_dino_head(in_dim=12, out_dim=20, hidden_dim=16, bottleneck_dim=8, norm_last_layer=False)
    assert trainable.last_layer.parametrizations.weight.original0.requires_grad


def test_head_survives_state_dict_and_deepcopy() -> None:
    torch.manual_seed(1)
    head = build_dino_head(in_dim=6, out_dim=10, hidden_dim=8, bottleneck_dim=4, batch_norm=True).eval()
    x = torch.randn(3, 6)
    copied = frozen_copy(head)
    assert torch.allclose(copied(x), head(x))
    assert all(not p.requires_grad for p in copied.parameters())
    other = build_dino_head(in_dim=6, out_dim=10, hidden_dim=8, bottleneck_dim=4, batch_norm=True).eval()
    other.load_state_dict(copy.deepcopy(head.state_dict()))
    assert torch.allclose(other(x), head(x))
    assert "last_layer.parametrizations.weight.original1" in head.state_dict()


# ---------------------------------------------------------------------------------------- model
class _Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.out_dim = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_dino(_Trunk(), build_dino_head(8, out_dim=6, hidden_dim=16, bottleneck_dim=4))


def test_model_teacher_sees_global_crops_and_starts_equal() -> None:
    model = _model()
    views = [torch.randn(3, 4) for _ in range(4)]
    out = model(views)
    assert len(out["projections"]) == 4 and len(out["targets"]) == 2
    assert [t.shape for t in out["targets"]] == [torch.Size([3, 6])] * 2
    for s, t in zip(out["projections"][:2], out["targets"]):
        assert torch.allclose(s, t, atol=1e-6)  # the teacher starts as a copy of the student
        assert not t.requires_grad
    assert all(not p.requires_grad for p in model.teacher_trunk.parameters())
    assert all(not p.requires_grad for p in model.teacher_head.parameters())
    pairs = model.momentum_pairs()
    assert pairs[0] == (model.trunk, model.teacher_trunk) and pairs[1] == (model.head, model.teacher_head)


class _LastLayerRecorder(SSLHook):
    name = "last_layer_recorder"
    slot = Slot.MONITOR  # after the freeze hook (Slot.METHOD)

    def __init__(self) -> None:
        self.grads: list[tuple[int, torch.Tensor | None]] = []
        self.weights: list[torch.Tensor] = []

    def on_backward(self, task: SSLTask) -> None:
        v = task.base_model.head.last_layer.parametrizations.weight.original1
        self.grads.append((task.epoch, None if v.grad is None else v.grad.clone()))

    def on_update(self, task: SSLTask) -> None:
        self.weights.append(task.base_model.head.last_layer.weight.detach().clone())


def test_last_layer_gradient_dropped_in_the_first_epoch_only() -> None:
    model = _model()
    initial = model.head.last_layer.weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    data = [{"input": [torch.randn(4, generator=g) for _ in range(3)], "target": 0} for _ in range(8)]
    rec = _LastLayerRecorder()
    task = SSLTask(
        Training(model=model, loss=DINOLoss(out_dim=6),
                 optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
                 lr_schedule=OnProgress(lambda where: 0.5)),
        DataPlan(loaders={"train": DataLoader(data, batch_size=4)},
                 phases=[Phase(train=True, epoch=0), Phase(train=True, epoch=1)]),
        [rec, FreezeLastLayerHook(freeze_last_layer_epochs=1)], max_steps=4,
    )
    train(task, standard_train_step)
    assert [e for e, _ in rec.grads] == [0, 0, 1, 1]
    assert rec.grads[0][1] is None and rec.grads[1][1] is None
    assert all(gr is not None and gr.abs().sum() > 0 for _, gr in rec.grads[2:])
    assert torch.equal(rec.weights[1], initial)  # unchanged through the frozen epoch
    assert not torch.allclose(rec.weights[2], initial)


# ---------------------------------------------------------------------------------------- recipe
@pytest.mark.slow
def test_recipe_runs_and_checkpoints_teacher_and_center(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_main("config=dino", *SMALL, "optim.max_steps=3", "eval.knn.enabled=false", "data.transform.num_small=2",
            "model.head.bottleneck_dim=8", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
            f"output_dir={out}")
    ckpts = out / "checkpoints"
    first = torch.load(ckpts / "checkpoint_000000001.pt", weights_only=False)
    last = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    assert last["position"]["step"] == 3
    center = last["loss"]["center.value"]
    assert center.shape == (1, 16) and center.abs().sum() > 0  # moved from its zero initial value
    assert not torch.equal(center, first["loss"]["center.value"])
    assert "_extra_state" not in last["loss"]  # the schedule reads the task's clock: no count of its own
    model = last["model"]
    teacher_keys = [k for k in model if k.startswith("teacher_")]
    assert "teacher_head.last_layer.parametrizations.weight.original1" in teacher_keys
    moved = [k for k in teacher_keys if model[k].is_floating_point() and not torch.equal(model[k], first["model"][k])]
    assert moved, "the EMA teacher did not move between step 1 and step 3"
    # the teacher lags the student
    assert not torch.equal(model["teacher_trunk.features.0.weight"], model["trunk.features.0.weight"])
    assert "momentum_teacher" in last["hooks"]
