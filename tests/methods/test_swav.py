"""SwAV: Sinkhorn codes and the swapped prediction loss against independent computations, queue, prototype hook."""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL, metrics, run_main
from torch import nn
from torch.utils.data import DataLoader

from sslkit.clock import StepContext, TrainClock
from sslkit.hooks.base import Slot, SSLHook
from sslkit.methods.sinkhorn import sinkhorn_knopp
from sslkit.methods.swav import SwAVLoss, SwAVPrototypesHook, build_swav, swapped_prediction_loss
from sslkit.models.heads import MLPHead
from sslkit.optim.schedules import OnProgress
from sslkit.task import DataPlan, Phase, SSLTask, Training
from sslkit.train_steps.standard import standard_train_step
from sslkit.trainer import train


def sinkhorn(scores: torch.Tensor, eps: float = 0.05, iters: int = 3) -> torch.Tensor:
    """The shared Sinkhorn-Knopp as SwAV's loss calls it (float64)."""
    return sinkhorn_knopp(scores, eps, iters, dtype=torch.float64)


def reference_sinkhorn(scores: np.ndarray, eps: float, iters: int) -> np.ndarray:
    """Algorithm of SwAV's appendix (one process) in numpy float64, loops over prototypes and samples."""
    b, k = scores.shape
    p = np.exp(scores / eps)  # [B, K]
    p = p / p.sum()
    for _ in range(iters):
        for j in range(k):  # each prototype gets mass 1/K
            p[:, j] = p[:, j] / p[:, j].sum() / k
        for i in range(b):  # each sample gets mass 1/B
            p[i, :] = p[i, :] / p[i, :].sum() / b
    return p * b


def reference_loss(scores: list[torch.Tensor], codes: list[torch.Tensor], assign: list[int], t: float) -> float:
    """Eqs. 1-2 of Caron et al. (2020) with multi-crop, one sample and one prototype at a time."""
    n_views = len(scores)
    total = 0.0
    for i, q in zip(assign, codes):
        sub = 0.0
        for v in range(n_views):
            if v == i:
                continue
            s = scores[v].double()
            b, k = s.shape
            per_sample = 0.0
            for n in range(b):
                log_z = math.log(sum(math.exp(float(s[n, c]) / t) for c in range(k)))
                per_sample += -sum(float(q[n, c]) * (float(s[n, c]) / t - log_z) for c in range(k))
            sub += per_sample / b
        total += sub / (n_views - 1)
    return total / len(assign)


def random_scores(n_views: int, b: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(b, k, generator=g) * 2 - 1 for _ in range(n_views)]


# ------------------------------------------------------------------------------------- sinkhorn
@pytest.mark.parametrize("iters", [1, 3, 10])
def test_sinkhorn_matches_reference_loops(iters: int) -> None:
    s = random_scores(1, 12, 7)[0]
    expected = reference_sinkhorn(s.double().numpy(), 0.05, iters)
    assert np.allclose(sinkhorn(s, 0.05, iters).double().numpy(), expected, rtol=1e-5, atol=1e-7)


def test_sinkhorn_marginals_tight_with_many_iterations() -> None:
    b, k = 64, 16
    s = random_scores(1, b, k, seed=1)[0]
    q = sinkhorn(s, 0.05, 200).double()
    assert torch.allclose(q.sum(dim=1), torch.ones(b, dtype=torch.float64), atol=1e-6)  # samples: 1 each
    assert torch.allclose(q.sum(dim=0), torch.full((k,), b / k, dtype=torch.float64), rtol=1e-4)  # B/K each
    assert (q >= 0).all()


def test_sinkhorn_prototype_marginals_improve_monotonically() -> None:
    b, k = 64, 16
    s = random_scores(1, b, k, seed=2)[0]
    errors = []
    for it in range(1, 6):
        q = sinkhorn(s, 0.05, it).double()
        assert torch.allclose(q.sum(dim=1), torch.ones(b, dtype=torch.float64), atol=1e-5)  # exact after each
        errors.append(float((q.sum(dim=0) - b / k).abs().sum()))
    assert all(a > c for a, c in itertools.pairwise(errors)), errors
    # three iterations put every prototype within 35% of its share B/K for these peaked codes (eps 0.05)
    q3 = sinkhorn(s, 0.05, 3)
    assert torch.allclose(q3.sum(dim=0), torch.full((k,), b / k), rtol=0.35)


def test_sinkhorn_shift_invariant_and_overflow_safe() -> None:
    s = random_scores(1, 10, 5, seed=3)[0]
    q = sinkhorn(s, 0.05, 3)
    assert torch.allclose(sinkhorn(s + 30.0, 0.05, 3), q, atol=1e-6)  # exp(630) would overflow without the shift
    big = sinkhorn(s * 20.0, 0.05, 3)  # scores up to 20 / 0.05 = 400 in the exponent
    assert torch.isfinite(big).all() and torch.allclose(big.sum(dim=1), torch.ones(10), atol=1e-5)


def test_sinkhorn_permutation_equivariant() -> None:
    s = random_scores(1, 16, 6, seed=4)[0]
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(sinkhorn(s[perm]), sinkhorn(s)[perm], atol=1e-6)


# ----------------------------------------------------------------------------------------- loss
def test_swapped_prediction_matches_reference_with_given_codes() -> None:
    scores = random_scores(4, 5, 6, seed=5)  # 2 global + 2 small crops
    g = torch.Generator().manual_seed(6)
    codes = [torch.softmax(torch.randn(5, 6, generator=g), dim=1) for _ in range(2)]
    got = swapped_prediction_loss(scores, codes, [0, 1], 0.1).item()
    assert got == pytest.approx(reference_loss(scores, codes, [0, 1], 0.1), rel=1e-5)
    # a single assignment crop, another temperature
    got1 = swapped_prediction_loss(scores, codes[:1], [1], 0.5).item()
    assert got1 == pytest.approx(reference_loss(scores, codes[:1], [1], 0.5), rel=1e-5)


def test_loss_module_is_sinkhorn_then_swapped_prediction() -> None:
    scores = random_scores(3, 8, 5, seed=7)
    loss = SwAVLoss(temperature=0.1, epsilon=0.05, sinkhorn_iterations=3, embedding_dim=4)
    codes = [torch.from_numpy(reference_sinkhorn(scores[i].double().numpy(), 0.05, 3)).float() for i in (0, 1)]
    expected = reference_loss(scores, codes, [0, 1], 0.1)
    assert loss({"scores": scores}, {}).item() == pytest.approx(expected, rel=1e-5)


def test_loss_invariant_to_batch_permutation() -> None:
    scores = random_scores(4, 16, 8, seed=8)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    loss = SwAVLoss(embedding_dim=4)
    base = loss({"scores": scores}, {})
    assert torch.allclose(loss({"scores": [s[perm] for s in scores]}, {}), base, atol=1e-5)


def test_loss_gradient_flows_only_through_predictions() -> None:
    scores = [s.requires_grad_() for s in random_scores(2, 6, 4, seed=9)]
    codes = [sinkhorn(s) for s in scores]
    loss = swapped_prediction_loss(scores, codes, [0, 1], 0.1)
    loss.backward()
    # d/ds_v of -sum q log softmax(s_v / T) / B = (softmax(s_v / T) - q_i) / (T B), i the other crop
    for v, i in ((0, 1), (1, 0)):
        expected = (torch.softmax(scores[v].detach() / 0.1, dim=1) - codes[i]) / (0.1 * 6) / 2
        assert torch.allclose(scores[v].grad, expected, atol=1e-5)


def test_aligned_views_give_lower_loss_than_random() -> None:
    g = torch.Generator().manual_seed(10)
    z = torch.nn.functional.normalize(torch.randn(32, 8, generator=g), dim=1)
    protos = torch.nn.functional.normalize(torch.randn(10, 8, generator=g), dim=1)
    other = torch.nn.functional.normalize(torch.randn(32, 8, generator=g), dim=1)
    loss = SwAVLoss(embedding_dim=8)
    aligned = loss({"scores": [z @ protos.T, z @ protos.T]}, {})
    shuffled = loss({"scores": [z @ protos.T, other @ protos.T]}, {})
    assert aligned < shuffled


# ---------------------------------------------------------------------------------------- queue
def _out(b: int = 4, d: int = 3, k: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    proj = [torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=1) for _ in range(3)]
    protos = torch.nn.functional.normalize(torch.randn(k, d, generator=g), dim=1)
    return {"projections": proj, "scores": [p @ protos.T for p in proj], "prototypes": protos}


def _at(update: int, micro: int = 0, micro_batches: int = 1) -> StepContext:
    return StepContext(TrainClock(step=update, micro_batch=micro, micro_batches=micro_batches), True,
                       torch.device("cpu"))


def test_queue_fills_newest_first_and_joins_sinkhorn_when_full() -> None:
    loss = SwAVLoss(queue_length=6, queue_start_step=1, embedding_dim=3)
    outs = [_out(seed=s) for s in range(4)]
    loss(outs[0], {}, _at(0))  # update 0: before queue_start_step, nothing queued
    assert loss.queue_filled == 0 and loss.queue.abs().sum() == 0
    loss(outs[1], {}, _at(1))
    assert loss.queue_filled == 4 and not loss.queue_active
    assert torch.equal(loss.queue[0, :4], outs[1]["projections"][0])
    assert torch.equal(loss.queue[1, :4], outs[1]["projections"][1])
    loss(outs[2], {}, _at(2))
    assert loss.queue_filled == 6 and loss.queue_active
    expected_q0 = torch.cat([outs[2]["projections"][0][:4], outs[1]["projections"][0][:2]])
    assert torch.equal(loss.queue[0], expected_q0)  # newest first, the oldest dropped
    # with the full queue, the codes are Sinkhorn over [queue scores; batch scores], batch rows kept
    queue_before = loss.queue.clone()
    out = outs[3]
    stacked = torch.cat([queue_before[0] @ out["prototypes"].T, out["scores"][0]])
    expected = torch.from_numpy(reference_sinkhorn(stacked.double().numpy(), 0.05, 3)[-4:]).float()
    assert torch.allclose(loss.codes(out)[0], expected, atol=1e-5)
    # state dict round trip (queue buffer and counters)
    state = loss.state_dict()
    fresh = SwAVLoss(queue_length=6, queue_start_step=1, embedding_dim=3)
    fresh.load_state_dict(state)
    assert fresh.queue_filled == 6 and torch.equal(fresh.queue, loss.queue)


def test_queue_starts_at_the_same_update_with_accumulation() -> None:
    """queue_start_step counts optimizer updates: with 2 micro-batches per update, nothing is queued during
    updates 0-1 (4 forwards), and both micro-batches of update 2 push theirs."""
    loss = SwAVLoss(queue_length=8, queue_start_step=2, embedding_dim=3)
    for update in range(2):
        for micro in range(2):
            loss(_out(seed=update * 2 + micro), {}, _at(update, micro, 2))
    assert loss.queue_filled == 0
    loss(_out(seed=10), {}, _at(2, 0, 2))
    loss(_out(seed=11), {}, _at(2, 1, 2))
    assert loss.queue_filled == 8


def test_eval_forward_leaves_state_unchanged() -> None:
    loss = SwAVLoss(queue_length=4, embedding_dim=3)
    with torch.no_grad():
        loss(_out(), {})
    assert loss.queue_filled == 0 and loss.queue.abs().sum() == 0


def test_queue_needs_matching_embedding_dim() -> None:
    loss = SwAVLoss(queue_length=4, embedding_dim=7)
    with pytest.raises(ValueError, match="embedding_dim"):
        loss(_out(), {})


# ------------------------------------------------------------------------------ collapse warning
def test_collapse_warning_fires_for_constant_embeddings(caplog: pytest.LogCaptureFixture) -> None:
    k = 10
    protos = torch.nn.functional.normalize(torch.randn(k, 6, generator=torch.Generator().manual_seed(0)), dim=1)
    z = torch.nn.functional.normalize(torch.ones(16, 6), dim=1)  # every sample the same embedding
    out = {"projections": [z, z], "scores": [z @ protos.T, z @ protos.T], "prototypes": protos}
    loss = SwAVLoss(embedding_dim=6, collapse_check_every=3)
    with caplog.at_level(logging.WARNING, logger="sslkit"):
        for update in range(5):
            value = loss(out, {}, _at(update))
        assert value.item() >= math.log(k) - 1e-5  # uniform codes: the loss is at least ln K
        assert not caplog.records  # the first window (updates 0-2) is not judged; the next ends at update 5
        loss(out, {}, _at(5))
        assert len(caplog.records) == 1 and "ln(K)" in caplog.records[0].getMessage()
        for update in range(6, 9):
            loss(out, {}, _at(update))
    assert len(caplog.records) == 2  # rate: one warning per window


def test_no_collapse_warning_for_informative_embeddings(caplog: pytest.LogCaptureFixture) -> None:
    k = 8
    protos = torch.eye(k)
    z = torch.eye(k).repeat(2, 1)  # 16 samples, each on one prototype, 2 per prototype
    out = {"projections": [z, z], "scores": [z @ protos.T, z @ protos.T], "prototypes": protos}
    loss = SwAVLoss(embedding_dim=k, collapse_check_every=2)
    with caplog.at_level(logging.WARNING, logger="sslkit"):
        for update in range(6):
            value = loss(out, {}, _at(update))
    assert value.item() < 0.5 * math.log(k)
    assert not caplog.records


# ---------------------------------------------------------------------------- model and the hook
class _Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.out_dim = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_model_outputs() -> None:
    torch.manual_seed(0)
    model = build_swav(_Trunk(), MLPHead(8, 16, 6), num_prototypes=5)
    views = [torch.randn(3, 4) for _ in range(2)]
    out = model(views)
    assert [p.shape for p in out["projections"]] == [torch.Size([3, 6])] * 2
    assert [s.shape for s in out["scores"]] == [torch.Size([3, 5])] * 2
    assert torch.allclose(out["projections"][0].norm(dim=1), torch.ones(3), atol=1e-6)
    assert torch.allclose(model.prototypes.weight.norm(dim=1), torch.ones(5), atol=1e-6)
    assert torch.allclose(out["scores"][1], out["projections"][1] @ model.prototypes.weight.T, atol=1e-6)
    assert not out["prototypes"].requires_grad


class _GradRecorder(SSLHook):
    name = "grad_recorder"
    slot = Slot.MONITOR  # after the swav hook (Slot.METHOD)

    def __init__(self) -> None:
        self.grads: list[torch.Tensor | None] = []
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def on_backward(self, task: SSLTask) -> None:
        g = task.base_model.prototypes.weight.grad
        self.grads.append(None if g is None else g.clone())

    def on_update(self, task: SSLTask) -> None:
        w = task.base_model.prototypes.weight.detach()
        self.norms.append(w.norm(dim=1))
        self.weights.append(w.clone())


def test_prototype_hook_normalises_and_freezes_in_the_standard_step() -> None:
    torch.manual_seed(0)
    model = build_swav(_Trunk(), MLPHead(8, 16, 6, batch_norm=False), num_prototypes=5)
    with torch.no_grad():
        model.prototypes.weight.mul_(3.0)  # off the sphere: on_start must bring it back
    g = torch.Generator().manual_seed(1)
    data = [{"input": [torch.randn(4, generator=g), torch.randn(4, generator=g)], "target": 0} for _ in range(40)]
    rec = _GradRecorder()
    task = SSLTask(
        Training(model=model, loss=SwAVLoss(embedding_dim=6, epsilon=0.5),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-4),
                 lr_schedule=OnProgress(lambda where: 0.5)),
        DataPlan(loaders={"train": DataLoader(data, batch_size=8)}, phases=[Phase(train=True, epoch=0)]),
        [rec, SwAVPrototypesHook(freeze_prototypes_steps=2)], max_steps=5,
    )
    train(task, standard_train_step)
    assert task.clock.step == 5
    assert rec.grads[0] is None and rec.grads[1] is None  # frozen: no gradient, the optimizer skips them
    assert all(gr is not None and gr.abs().sum() > 0 for gr in rec.grads[2:])
    start = rec.weights[0]
    assert torch.allclose(start.norm(dim=1), torch.ones(5), atol=1e-6)  # normalised at on_start, not moved
    assert torch.allclose(rec.weights[1], start, rtol=0, atol=1e-7)
    assert not torch.allclose(rec.weights[2], start)  # the first unfrozen step moves them
    for n in rec.norms:
        assert torch.allclose(n, torch.ones(5), atol=1e-6)


def test_prototype_hook_names_missing_module() -> None:
    from helpers import make_task

    task = make_task([Phase(train=True, epoch=0)], [SwAVPrototypesHook()])
    with pytest.raises(AttributeError, match="no submodule 'prototypes'"):
        train(task, standard_train_step)


# ----------------------------------------------------------------------------------------- recipe
@pytest.mark.slow
def test_recipe_runs_and_checkpoints_the_queue(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_main("config=swav", *SMALL, "optim.max_steps=3", "eval.knn.enabled=false", "loss.queue_length=24",
            "model.kwargs.num_prototypes=10", "data.transform.num_small=2", f"output_dir={out}")
    ckpts = out / "checkpoints"
    state = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    assert state["position"]["step"] == 3
    loss_state = state["loss"]
    extra = loss_state["_extra_state"]
    assert (extra["queue_filled"], extra["window_count"]) == (24, 3)
    # the collapse check's open window (saved so a resumed run judges the same windows): the sum of the 3
    # train losses, which metrics.jsonl logs as the mean of steps 1-2 (at step 2) and of step 3 (epoch end)
    losses = {r["step"]: r["loss"] for r in metrics(out) if r.get("phase") == "train" and "loss" in r}
    assert extra["window_sum"] == pytest.approx(2 * losses[2] + losses[3], rel=1e-5)
    queue = loss_state["queue"]
    assert queue.shape == (2, 24, 16) and queue.abs().sum() > 0  # filled from its zero initial value
    assert torch.allclose(queue[0].norm(dim=1), torch.ones(24), atol=1e-5)
    protos = state["model"]["prototypes.weight"]
    assert protos.shape == (10, 16) and torch.allclose(protos.norm(dim=1), torch.ones(10), atol=1e-5)
    assert "swav_prototypes" in state["hooks"]
