"""SimSiam: the loss against the paper's formula, stop-gradient, invariances, the model wiring, the recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import SMALL, TinyTrunk, run_main

from sslkit.methods.simsiam import SimSiamLoss, build_simsiam, negative_cosine
from sslkit.models.heads import MLPHead


def reference_d(p: torch.Tensor, z: torch.Tensor) -> float:
    """Chen & He 2021, eq. 1, one sample at a time: D(p, z) = -(p/|p|) . (z/|z|), batch mean."""
    total = 0.0
    for i in range(p.shape[0]):
        dot = sum(float(a) * float(b) for a, b in zip(p[i], z[i]))
        total += -dot / (math.sqrt(sum(float(a) ** 2 for a in p[i])) * math.sqrt(sum(float(b) ** 2 for b in z[i])))
    return total / p.shape[0]


def test_negative_cosine_matches_reference_and_known_values() -> None:
    g = torch.Generator().manual_seed(0)
    p, z = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert negative_cosine(p, z).item() == pytest.approx(reference_d(p, z), rel=1e-5)
    assert negative_cosine(z, 2 * z).item() == pytest.approx(-1.0, abs=1e-6)  # aligned: the minimum
    assert negative_cosine(-z, z).item() == pytest.approx(1.0, abs=1e-6)
    assert negative_cosine(torch.eye(3), torch.eye(3).roll(1, 0)).item() == pytest.approx(0.0, abs=1e-7)


def test_loss_is_half_sum_of_both_directions_and_symmetric() -> None:
    g = torch.Generator().manual_seed(1)
    p0, p1, z0, z1 = (torch.randn(8, 6, generator=g) for _ in range(4))
    loss = SimSiamLoss()
    value = loss({"predictions": [p0, p1], "targets": [z1, z0]}, {})
    assert value.item() == pytest.approx(reference_d(p0, z1) / 2 + reference_d(p1, z0) / 2, rel=1e-5)
    assert torch.allclose(loss({"predictions": [p1, p0], "targets": [z0, z1]}, {}), value)
    perm = torch.randperm(8, generator=g)
    permuted = loss({"predictions": [p0[perm], p1[perm]], "targets": [z1[perm], z0[perm]]}, {})
    assert torch.allclose(permuted, value, atol=1e-6)
    assert loss({"predictions": [z1, z0], "targets": [z1, z0]}, {}).item() == pytest.approx(-1.0, abs=1e-6)


def test_stop_gradient_on_the_target() -> None:
    p = torch.randn(4, 3, requires_grad=True)
    z = torch.randn(4, 3, requires_grad=True)
    negative_cosine(p, z).backward()
    assert p.grad is not None and z.grad is None




def test_model_outputs_and_gradient_paths() -> None:
    torch.manual_seed(0)
    model = build_simsiam(TinyTrunk(), MLPHead(6, 8, 8, num_layers=3, last_bn=True), predictor_hidden_dim=2)
    assert model.momentum_pairs() == []  # no teacher
    g = torch.Generator().manual_seed(0)
    v0, v1 = torch.randn(8, 1, 2, 2, generator=g), torch.randn(8, 1, 2, 2, generator=g)
    out = model([v0, v1])
    z0, z1 = out["projections"]
    assert torch.equal(out["targets"][0], z1.detach()) and torch.equal(out["targets"][1], z0.detach())
    assert not any(t.requires_grad for t in out["targets"])
    assert [p.shape for p in out["predictions"]] == [(8, 8), (8, 8)]
    # the gradient reaches the encoder only through the predictor branch
    SimSiamLoss()(out, {}).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="two views"):
        model([v0])


@pytest.mark.slow
def test_recipe_runs_and_logs_the_collapse_monitor(tmp_path: Path) -> None:
    out = tmp_path / "simsiam"
    run_main("config=simsiam", *SMALL, "eval.knn.enabled=false", "model.kwargs.predictor_hidden_dim=8",
            "optim.max_steps=3", f"output_dir={out}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("phase") == "train"]
    assert train and all(-1.0 <= r["loss"] <= 1.0 for r in train)
    assert all(0.0 < r["embedding_std_ratio"] for r in train)
    ckpts = out / "checkpoints"
    state = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    assert state["position"]["step"] == 3 and any(k.startswith("predictor.") for k in state["model"])
