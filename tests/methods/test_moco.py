"""MoCo v2 / v3: losses against the papers' formulas, the key queue, shuffle-BN, the teacher and its EMA, recipes."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import SMALL, TinyTrunk, run_main
from torch import nn

from sslkit.checkpoint import Checkpointer
from sslkit.clock import TrainClock
from sslkit.hooks.ema import MomentumTeacherHook
from sslkit.methods.moco import (
    MoCoLoss,
    MoCoModel,
    MoCoV3Loss,
    build_moco,
    build_mocov3,
    moco_infonce,
    mocov3_infonce,
    shuffled_forward,
)
from sslkit.models.heads import MLPHead
from sslkit.optim import build_optimizer
from sslkit.optim.schedules import momentum_at


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def reference_moco(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, t: float) -> float:
    """He et al. 2020, eq. 1, one query at a time: -log(e^{q.k+/T} / (e^{q.k+/T} + sum_i e^{q.k_i/T}))."""
    q, k, queue = unit(q.double()), unit(k.double()), queue.double()
    total = 0.0
    for i in range(q.shape[0]):
        pos = math.exp(float(q[i] @ k[i]) / t)
        neg = sum(math.exp(float(q[i] @ queue[j]) / t) for j in range(queue.shape[0]))
        total += -math.log(pos / (pos + neg))
    return total / q.shape[0]


def reference_mocov3(q: torch.Tensor, k: torch.Tensor, t: float) -> float:
    """Chen, Xie & He 2021, Algorithm 1 ctr(q, k): CE over the batch's keys, label = own key, times 2T."""
    q, k = unit(q.double()), unit(k.double())
    total = 0.0
    for i in range(q.shape[0]):
        num = math.exp(float(q[i] @ k[i]) / t)
        den = sum(math.exp(float(q[i] @ k[j]) / t) for j in range(k.shape[0]))
        total += -math.log(num / den)
    return total / q.shape[0] * 2 * t




def tiny_views(b: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, 1, 2, 2, generator=g), torch.randn(b, 1, 2, 2, generator=g)]


# ------------------------------------------------------------------------------ MoCo v2 loss
@pytest.mark.parametrize("t", [0.07, 0.2, 1.0])
def test_moco_infonce_matches_reference(t: float) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    queue = unit(torch.randn(7, 4, generator=g))
    assert moco_infonce(q, k, queue, t).item() == pytest.approx(reference_moco(q, k, queue, t), rel=1e-5)


def test_moco_infonce_hand_computed() -> None:
    # q = k along e1, the K queued keys orthogonal to it: -log(e^{1/T} / (e^{1/T} + K))
    q = torch.tensor([[3.0, 0.0, 0.0]])
    k = torch.tensor([[0.5, 0.0, 0.0]])
    queue = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    t = 0.2
    expected = -math.log(math.exp(1 / t) / (math.exp(1 / t) + 3))
    assert moco_infonce(q, k, queue, t).item() == pytest.approx(expected, rel=1e-6)


def test_moco_infonce_invariances_and_minimum() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    queue = unit(torch.randn(32, 16, generator=g))
    base = moco_infonce(q, k, queue)
    perm = torch.randperm(8, generator=g)
    assert torch.allclose(moco_infonce(q[perm], k[perm], queue), base, atol=1e-6)
    assert torch.allclose(moco_infonce(q, k, queue[torch.randperm(32, generator=g)]), base, atol=1e-6)
    assert torch.allclose(moco_infonce(2 * q, 5 * k, queue), base, atol=1e-6)  # cosine: scale-free
    aligned = moco_infonce(q, q, queue)
    assert aligned < base
    assert aligned <= moco_infonce(q, q + 0.3 * torch.randn(8, 16, generator=g), queue)


def test_moco_key_gets_no_gradient() -> None:
    q = torch.randn(4, 3, requires_grad=True)
    k = torch.randn(4, 3, requires_grad=True)
    moco_infonce(q, k, unit(torch.randn(5, 3))).backward()
    assert q.grad is not None and k.grad is None


# ----------------------------------------------------------------------------------- queue
def test_queue_is_fifo_and_wraps() -> None:
    loss = MoCoLoss(queue_size=5, dim=2)
    init = loss.queue.clone()
    assert torch.allclose(init.norm(dim=1), torch.ones(5))  # random unit vectors
    g = torch.Generator().manual_seed(0)
    keys = [unit(torch.randn(2, 2, generator=g)) for _ in range(3)]  # 6 keys into a queue of 5
    loss.enqueue(keys[0])
    assert torch.allclose(loss.queue[:2], keys[0]) and torch.equal(loss.queue[2:], init[2:])
    assert loss.queue_ptr.item() == 2
    loss.enqueue(keys[1])
    loss.enqueue(keys[2])  # rows 4 and (wrapping) 0
    assert torch.allclose(loss.queue[0], keys[2][1])  # the oldest key (keys[0][0]) went out first
    assert torch.allclose(loss.queue[1], keys[0][1])
    assert torch.allclose(loss.queue[2:4], keys[1])
    assert torch.allclose(loss.queue[4], keys[2][0])
    assert loss.queue_ptr.item() == 1


def test_queue_takes_a_batch_larger_than_itself() -> None:
    loss = MoCoLoss(queue_size=4, dim=3)
    g = torch.Generator().manual_seed(1)
    loss.enqueue(unit(torch.randn(3, 3, generator=g)))  # ptr 3
    big = unit(torch.randn(6, 3, generator=g))  # key j goes to row (3 + j) % 4; the last 4 survive
    loss.enqueue(big)
    for j in range(2, 6):
        assert torch.allclose(loss.queue[(3 + j) % 4], big[j])
    assert loss.queue_ptr.item() == (3 + 6) % 4


def test_queue_normalises_keys() -> None:
    loss = MoCoLoss(queue_size=3, dim=2)
    loss.enqueue(torch.tensor([[3.0, 4.0]]))
    assert torch.allclose(loss.queue[0], torch.tensor([0.6, 0.8]))


def test_loss_uses_old_queue_then_enqueues_only_when_training() -> None:
    torch.manual_seed(0)
    loss = MoCoLoss(temperature=0.2, queue_size=6, dim=4)
    q, k = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    before = loss.queue.clone()
    with torch.no_grad():  # eval: no enqueue
        loss({"projections": [q], "targets": [k]}, {})
    assert torch.equal(loss.queue, before) and loss.queue_ptr.item() == 0
    out = loss({"projections": [q], "targets": [k]}, {})
    assert out["loss"].item() == pytest.approx(reference_moco(q.detach(), k, before, 0.2), rel=1e-5)
    out["loss"].backward()  # the in-place enqueue did not break backward
    assert torch.allclose(loss.queue[:4], unit(k)) and loss.queue_ptr.item() == 4
    assert 0.0 <= out["acc"].item() <= 1.0


def test_symmetric_loss_is_mean_of_both_directions() -> None:
    g = torch.Generator().manual_seed(2)
    q0, q1, k0, k1 = (torch.randn(4, 3, generator=g) for _ in range(4))
    loss = MoCoLoss(queue_size=5, dim=3)
    queue = loss.queue.clone()
    out = loss({"projections": [q0, q1], "targets": [k1, k0]}, {})
    expected = (reference_moco(q0, k1, queue, 0.2) + reference_moco(q1, k0, queue, 0.2)) / 2
    assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
    assert loss.queue_ptr.item() == 8 % 5


def test_moco_loss_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="temperature"):
        MoCoLoss(temperature=0.0)
    with pytest.raises(ValueError, match=r"model.head.out_dim"):
        MoCoLoss(dim=8)({"projections": [torch.randn(2, 4)], "targets": [torch.randn(2, 4)]}, {})


# ------------------------------------------------------------------------------ shuffle-BN
class RecordingBN(nn.Module):
    """BatchNorm without affine that records every batch it normalises."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3, affine=False)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return self.bn(x)


@pytest.mark.parametrize("groups", [2, 4])
def test_shuffled_forward_normalises_each_key_within_a_random_group(groups: int) -> None:
    x = torch.randn(16, 3)
    enc = RecordingBN()
    out = shuffled_forward(enc, x, groups, seed=3)
    assert [s.shape[0] for s in enc.seen] == [16 // groups] * groups
    seen_rows = torch.cat(enc.seen)
    assert torch.equal(seen_rows.sort(dim=0).values, x.sort(dim=0).values)  # every row once
    assert not torch.equal(seen_rows, x)  # shuffled
    for i in range(16):  # out[i] is x[i] normalised with the statistics of its own group
        group = next(s for s in enc.seen if (s == x[i]).all(dim=1).any())
        mean, var = group.mean(0), group.var(0, unbiased=False)
        assert torch.allclose(out[i], (x[i] - mean) / torch.sqrt(var + 1e-5), atol=1e-5)


def test_shuffled_forward_unshuffles_and_one_group_is_plain() -> None:
    lin = nn.Linear(3, 2)
    x = torch.randn(10, 3)
    assert torch.allclose(shuffled_forward(lin, x, 2, seed=0), lin(x), atol=1e-6)
    enc = RecordingBN()
    assert torch.allclose(shuffled_forward(enc, x, 1, seed=0), nn.functional.batch_norm(
        x, None, None, training=True), atol=1e-5)
    with pytest.raises(ValueError, match="2 samples per group"):
        shuffled_forward(enc, torch.randn(3, 3), 2, seed=0)


def test_moco_model_counts_shuffles_in_its_state() -> None:
    model = build_moco(TinyTrunk(), MLPHead(6, 8, 4, batch_norm=False))
    model(tiny_views())
    model(tiny_views())
    state = model.state_dict()
    assert state["_extra_state"] == {"shuffle_step": 2}
    fresh = build_moco(TinyTrunk(), MLPHead(6, 8, 4, batch_norm=False))
    fresh.load_state_dict(state)
    assert fresh.shuffle_step == 2


# ------------------------------------------------------------------------------ MoCo v2 model
def test_moco_model_outputs_queries_and_keys_without_grad() -> None:
    torch.manual_seed(0)
    model = build_moco(TinyTrunk(), MLPHead(6, 8, 4, batch_norm=False))
    out = model(tiny_views())
    assert [t.shape for t in out["projections"]] == [(8, 4)] and len(out["features"]) == 1
    assert [t.shape for t in out["targets"]] == [(8, 4)] and not out["targets"][0].requires_grad
    sym = build_moco(TinyTrunk(), MLPHead(6, 8, 4, batch_norm=False), symmetric=True)
    v0, v1 = tiny_views()
    out = sym([v0, v1])
    assert len(out["projections"]) == 2 and len(out["targets"]) == 2
    sym.eval()  # running statistics: no batch dependence, so keys[i] is the key of the other view
    out = sym([v0, v1])
    assert torch.allclose(out["targets"][0], sym.teacher_head(sym.teacher_trunk(v1)), atol=1e-6)
    assert torch.allclose(out["targets"][1], sym.teacher_head(sym.teacher_trunk(v0)), atol=1e-6)
    with pytest.raises(ValueError, match="two views"):
        model([v0])


def test_teacher_starts_equal_gets_no_gradient_and_is_not_optimized() -> None:
    torch.manual_seed(0)
    for model in (build_moco(TinyTrunk(), MLPHead(6, 8, 4)), build_mocov3(TinyTrunk(), MLPHead(6, 8, 4), 8)):
        for (_, s), (_, t) in zip(model.trunk.named_parameters(), model.teacher_trunk.named_parameters()):
            assert torch.equal(s, t) and not t.requires_grad
        opt = build_optimizer(model, "sgd", 0.1)
        optimized = {id(p) for g in opt.param_groups for p in g["params"]}
        teacher = list(model.teacher_trunk.parameters()) + list(model.teacher_head.parameters())
        assert not optimized & {id(p) for p in teacher}
        assert {id(p) for p in model.trunk.parameters()} <= optimized
        out = model(tiny_views())
        loss = MoCoLoss(queue_size=16, dim=4) if isinstance(model, MoCoModel) else MoCoV3Loss()
        loss(out, {})["loss"].backward()
        assert all(p.grad is None for p in teacher)
        assert all(p.grad is not None for p in model.trunk.parameters())


@pytest.mark.parametrize(("where", "schedule"), [(0.0, "constant"), (0.3, "cosine")])
def test_ema_hook_moves_teacher_by_exactly_one_minus_m(where: float, schedule: str) -> None:
    torch.manual_seed(0)
    model = build_moco(TinyTrunk(), MLPHead(6, 8, 4))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    MoCoLoss(queue_size=16, dim=4)(model(tiny_views()), {})["loss"].backward()
    opt.step()
    hook = MomentumTeacherHook(base_momentum=0.9, final_momentum=1.0, schedule=schedule)
    m = momentum_at(where, 0.9, 1.0, schedule)
    pairs = [(s, t) for student, teacher in model.momentum_pairs()
             for s, t in zip(student.parameters(), teacher.parameters())]
    before = [(s.detach().clone(), t.clone()) for s, t in pairs]
    assert any(not torch.equal(s, t) for s, t in before)  # the step moved the student
    bn_before = model.teacher_trunk.bn.running_mean.clone()
    clock = TrainClock(step=round(where * 1000), max_steps=1000)
    scheduled: dict[str, float] = {}
    hook.on_update(SimpleNamespace(clock=clock, base_model=model, scheduled=scheduled))
    for (s, t), (_, t_new) in zip(before, pairs):
        assert torch.allclose(t_new, t + (1 - m) * (s - t), atol=1e-7)
    assert torch.equal(model.teacher_trunk.bn.running_mean, bn_before)  # buffers are not averaged
    assert hook.last_momentum == pytest.approx(m) and scheduled == {"teacher_momentum": pytest.approx(m)}


# ---------------------------------------------------------------------------------- MoCo v3
@pytest.mark.parametrize("t", [0.2, 1.0])
def test_mocov3_infonce_matches_reference(t: float) -> None:
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert mocov3_infonce(q, k, t).item() == pytest.approx(reference_mocov3(q, k, t), rel=1e-5)


def test_mocov3_loss_is_symmetric_sum_with_known_minimum() -> None:
    g = torch.Generator().manual_seed(5)
    p0, p1, k0, k1 = (torch.randn(8, 6, generator=g) for _ in range(4))
    loss = MoCoV3Loss(temperature=0.2)
    out = loss({"predictions": [p0, p1], "targets": [k1, k0]}, {})
    expected = reference_mocov3(p0, k1, 0.2) + reference_mocov3(p1, k0, 0.2)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
    swapped = loss({"predictions": [p1, p0], "targets": [k0, k1]}, {})
    assert torch.allclose(swapped["loss"], out["loss"])
    perm = torch.randperm(8, generator=g)
    permuted = loss({"predictions": [p0[perm], p1[perm]], "targets": [k1[perm], k0[perm]]}, {})
    assert torch.allclose(permuted["loss"], out["loss"], atol=1e-6)
    # orthonormal, aligned: each direction is 2T * -log(e^{1/T} / (e^{1/T} + (B - 1)))
    e = torch.eye(4)
    aligned = loss({"predictions": [e, e], "targets": [e, e]}, {})
    one = 2 * 0.2 * -math.log(math.exp(5) / (math.exp(5) + 3))
    assert aligned["loss"].item() == pytest.approx(2 * one, rel=1e-6)
    assert aligned["acc"].item() == 1.0


def test_mocov3_model_pairs_keys_with_the_other_view() -> None:
    torch.manual_seed(0)
    model = build_mocov3(TinyTrunk(), MLPHead(6, 8, 4, last_bn=True), predictor_hidden_dim=8)
    v0, v1 = tiny_views()
    out = model([v0, v1])
    assert out.given() == ["features", "projections", "predictions", "targets"]
    assert [t.shape for t in out["predictions"]] == [(8, 4), (8, 4)]
    assert not any(k.requires_grad for k in out["targets"])
    model.eval()
    out = model([v0, v1])
    assert torch.allclose(out["targets"][0], model.teacher_head(model.teacher_trunk(v1)), atol=1e-6)
    assert len(model.momentum_pairs()) == 2


# --------------------------------------------------------------------------------- recipes
def _recipe_run(tmp_path: Path, config: str, extra: list[str]) -> tuple[dict, dict, Path]:
    """3 steps of ``config``, then the initial state of the same build (same seed, no steps)."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config

    out = tmp_path / config
    args = [f"config={config}", *SMALL, "eval.knn.enabled=false", *extra]
    run_main(*args, "optim.max_steps=3", f"output_dir={out}")
    ckpts = out / "checkpoints"
    state = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    cfg = compose_config([*args, "optim.max_steps=3", f"output_dir={tmp_path / 'fresh'}"])
    task = build_task(cfg)
    init = {part: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in module.state_dict().items()}
            for part, module in (("model", task.base_model), ("loss", task.loss))}
    Checkpointer.restore(task, state)  # a fresh build takes the checkpoint back
    for key, value in state["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(task.base_model.state_dict()[key], value)
    return state, init, out


def _teacher_moved(state: dict, init: dict) -> None:
    teacher = [k for k in state["model"] if k.startswith("teacher_")]
    assert teacher
    assert any(not torch.equal(state["model"][k], init["model"][k]) for k in teacher if "weight" in k)


@pytest.mark.slow
def test_moco_recipe_checkpoints_teacher_and_queue_and_resumes(tmp_path: Path) -> None:
    extra = ["loss.queue_size=50"]  # 16 keys per step: 3 steps -> ptr 48, 5 steps -> 80 % 50 = 30
    state, init, out = _recipe_run(tmp_path, "moco", extra)
    _teacher_moved(state, init)
    assert state["loss"]["queue"].shape == (50, 16)
    assert not torch.equal(state["loss"]["queue"], init["loss"]["queue"])
    assert state["loss"]["queue_ptr"].item() == 48
    assert state["model"]["_extra_state"] == {"shuffle_step": 3}
    assert state["hooks"]["momentum_teacher"]["last_momentum"] == pytest.approx(0.99)
    proc = run_main("config=moco", *SMALL, "eval.knn.enabled=false", *extra, "optim.max_steps=5", f"output_dir={out}")
    assert "resumed from" in proc.stdout
    ckpts = out / "checkpoints"
    final = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    assert final["loss"]["queue_ptr"].item() == 30  # continued from 48, not restarted at 0
    assert final["model"]["_extra_state"] == {"shuffle_step": 5}
    assert not torch.equal(final["loss"]["queue"][:30], state["loss"]["queue"][:30])


@pytest.mark.slow
def test_mocov3_recipe_checkpoints_teacher(tmp_path: Path) -> None:
    state, init, _ = _recipe_run(tmp_path, "mocov3", ["model.kwargs.predictor_hidden_dim=32"])
    _teacher_moved(state, init)
    assert state["hooks"]["momentum_teacher"]["last_momentum"] > 0.99  # cosine schedule towards 1
