"""BYOL: the loss against the paper's formula, invariances, the online/target wiring, the recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import SMALL, TinyTrunk, run_main

from sslkit.checkpoint import Checkpointer
from sslkit.methods.byol import BYOLLoss, build_byol, byol_loss
from sslkit.models.heads import MLPHead
from sslkit.optim import build_optimizer


def reference_byol(p: torch.Tensor, z: torch.Tensor) -> float:
    """Grill et al. 2020, eq. 2, one sample at a time: || p/|p| - z/|z| ||^2, averaged over the batch."""
    total = 0.0
    for i in range(p.shape[0]):
        pn = [float(v) / math.sqrt(sum(float(u) ** 2 for u in p[i])) for v in p[i]]
        zn = [float(v) / math.sqrt(sum(float(u) ** 2 for u in z[i])) for v in z[i]]
        total += sum((a - b) ** 2 for a, b in zip(pn, zn))
    return total / p.shape[0]


def test_byol_loss_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    p, z = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert byol_loss(p, z).item() == pytest.approx(reference_byol(p, z), rel=1e-5)


def test_known_values() -> None:
    z = torch.randn(4, 8)
    assert byol_loss(z, z).item() == pytest.approx(0.0, abs=1e-6)  # 2 - 2 cos = 0 for identical vectors
    assert byol_loss(3 * z, z).item() == pytest.approx(0.0, abs=1e-6)  # scale-free
    assert byol_loss(-z, z).item() == pytest.approx(4.0, abs=1e-6)  # opposite: 2 - 2(-1)
    e = torch.eye(2)
    assert byol_loss(e, e.flip(0)).item() == pytest.approx(2.0, abs=1e-6)  # orthogonal: 2 - 0


def test_symmetrised_loss_is_the_sum_of_both_directions() -> None:
    g = torch.Generator().manual_seed(1)
    p0, p1, t0, t1 = (torch.randn(8, 6, generator=g) for _ in range(4))
    loss = BYOLLoss()
    out = loss({"predictions": [p0, p1], "targets": [t1, t0]}, {})
    assert out["loss"].item() == pytest.approx(reference_byol(p0, t1) + reference_byol(p1, t0), rel=1e-5)
    swapped = loss({"predictions": [p1, p0], "targets": [t0, t1]}, {})
    assert torch.allclose(swapped["loss"], out["loss"])
    perm = torch.randperm(8, generator=g)
    permuted = loss({"predictions": [p0[perm], p1[perm]], "targets": [t1[perm], t0[perm]]}, {})
    assert torch.allclose(permuted["loss"], out["loss"], atol=1e-6)
    perfect = loss({"predictions": [t1, t0], "targets": [t1, t0]}, {})
    assert perfect["loss"].item() == pytest.approx(0.0, abs=1e-6) and perfect["cos"].item() == pytest.approx(1.0)
    worst = loss({"predictions": [-t1, -t0], "targets": [t1, t0]}, {})
    assert worst["loss"].item() == pytest.approx(8.0, abs=1e-5)


def test_target_gets_no_gradient() -> None:
    p = torch.randn(4, 3, requires_grad=True)
    z = torch.randn(4, 3, requires_grad=True)
    byol_loss(p, z).backward()
    assert p.grad is not None and z.grad is None




def test_model_wiring_teacher_frozen_and_outside_the_optimizer() -> None:
    torch.manual_seed(0)
    model = build_byol(TinyTrunk(), MLPHead(6, 8, 4), predictor_hidden_dim=8)
    assert model.predictor.out_dim == 4
    g = torch.Generator().manual_seed(0)
    v0, v1 = torch.randn(8, 1, 2, 2, generator=g), torch.randn(8, 1, 2, 2, generator=g)
    out = model([v0, v1])
    assert [t.shape for t in out["predictions"]] == [(8, 4), (8, 4)]
    assert [t.shape for t in out["targets"]] == [(8, 4), (8, 4)]
    assert not any(t.requires_grad for t in out["targets"])
    teacher = list(model.teacher_trunk.parameters()) + list(model.teacher_head.parameters())
    assert teacher and not any(p.requires_grad for p in teacher)
    opt = build_optimizer(model, "sgd", 0.1)
    optimized = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in teacher}
    assert {id(p) for p in model.predictor.parameters()} <= optimized
    BYOLLoss()(out, {})["loss"].backward()
    assert all(p.grad is None for p in teacher)
    assert all(p.grad is not None for p in model.predictor.parameters())
    model.eval()  # running statistics: targets[i] is the target network's projection of the other view
    out = model([v0, v1])
    assert torch.allclose(out["targets"][0], model.teacher_head(model.teacher_trunk(v1)), atol=1e-6)
    assert torch.allclose(out["targets"][1], model.teacher_head(model.teacher_trunk(v0)), atol=1e-6)
    pairs = model.momentum_pairs()
    assert pairs[0] == (model.trunk, model.teacher_trunk) and pairs[1] == (model.head, model.teacher_head)
    with pytest.raises(ValueError, match="two views"):
        model([v0])


@pytest.mark.slow
def test_recipe_checkpoints_the_target_network_and_resumes(tmp_path: Path) -> None:
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config

    out = tmp_path / "byol"
    args = ["config=byol", *SMALL, "eval.knn.enabled=false", "model.kwargs.predictor_hidden_dim=32"]
    run_main(*args, "optim.max_steps=3", f"output_dir={out}")
    ckpts = out / "checkpoints"
    state = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    task = build_task(compose_config([*args, "optim.max_steps=3", f"output_dir={tmp_path / 'fresh'}"]))
    init = {k: v.clone() for k, v in task.base_model.state_dict().items()}
    teacher = [k for k in state["model"] if k.startswith("teacher_") and k.endswith("weight")]
    assert teacher and any(not torch.equal(state["model"][k], init[k]) for k in teacher)
    assert 0.99 < state["hooks"]["momentum_teacher"]["last_momentum"] < 1.0
    Checkpointer.restore(task, state)
    for k in teacher:
        assert torch.equal(task.base_model.state_dict()[k], state["model"][k])
    # a second run in the same folder resumes (the first run's epoch is done: 5 steps need a 2nd epoch)
    proc = run_main(*args, "optim.max_steps=5", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
                   f"output_dir={out}")
    assert "resumed from" in proc.stdout
    step4 = torch.load(ckpts / "checkpoint_000000004.pt", weights_only=False)
    assert step4["position"]["step"] == 4
    # the 4th step's EMA started from the checkpointed target: t4 = m t3 + (1 - m) s4
    m = step4["hooks"]["momentum_teacher"]["last_momentum"]
    for k in teacher:
        student = step4["model"][k.removeprefix("teacher_")]
        assert torch.allclose(step4["model"][k], m * state["model"][k] + (1 - m) * student, atol=1e-6)
