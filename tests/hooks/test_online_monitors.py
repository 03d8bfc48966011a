"""Online monitors: RankMe against its formula, the online probe learns without touching the training."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sslkit.hooks.online import OnlineMonitorHook, rankme
from tests.helpers import SMALL, metrics, run_main


def test_rankme_of_known_ranks() -> None:
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    for r in (1, 5, 16):
        z = q[:, :r] @ torch.linalg.qr(torch.randn(32, 32, generator=g))[0][:r]  # r equal singular values
        assert rankme(z).item() == pytest.approx(r, rel=1e-3)
    z = torch.randn(200, 24, generator=g)
    s = np.linalg.svd(z.double().numpy(), compute_uv=False)
    p = s / s.sum() + 1e-7
    assert rankme(z).item() == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-5)
    assert rankme(torch.ones(50, 8)).item() == pytest.approx(1.0, abs=1e-3)  # every row the same: collapse


def test_probe_learns_without_a_gradient_into_the_features() -> None:
    g = torch.Generator().manual_seed(1)
    hook = OnlineMonitorHook(feature_dim=6, num_classes=3, linear_lr=0.5)
    centres = torch.randn(3, 6, generator=g) * 3
    for _ in range(60):
        y = torch.randint(0, 3, (32,), generator=g)
        feats = (centres[y] + torch.randn(32, 6, generator=g)).requires_grad_()
        hook._train_probe(feats, y)
        assert feats.grad is None
    hook.correct.zero_()
    hook.seen.zero_()
    y = torch.randint(0, 3, (256,), generator=g)
    y[:10] = -1  # unlabelled samples are not counted
    hook._train_probe(centres[y.clamp_min(0)] + torch.randn(256, 6, generator=g), y)
    assert hook.seen.item() == 246 and hook.correct.item() / 246 > 0.9

    other = OnlineMonitorHook(feature_dim=6, num_classes=3, linear_lr=0.5)
    other.load_state_dict(copy.deepcopy(hook.state_dict()))  # as a checkpoint would: no shared tensors
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    hook._train_probe(x, y)
    other._train_probe(x, y)  # same weights and momentum: the same next step
    assert torch.equal(hook.probe.weight, other.probe.weight) and hook.correct == other.correct


def test_monitors_leave_the_training_bit_identical(tmp_path: Path) -> None:
    """A run with the monitors logs the same losses as one without, plus RankMe and the probe's figures; auto is
    off on the CPU."""
    common = ("config=simclr", *SMALL, "optim.epochs=2", "log.tensorboard=false", "eval.knn.enabled=false")
    run_main(*common, "eval.monitors.enabled=true", f"output_dir={tmp_path / 'on'}")
    run_main(*common, f"output_dir={tmp_path / 'auto'}")
    on, auto = metrics(tmp_path / "on"), metrics(tmp_path / "auto")
    losses = [(r["step"], r["loss"]) for r in on if "loss" in r]
    assert losses and losses == [(r["step"], r["loss"]) for r in auto if "loss" in r]
    assert not any(k.startswith(("rankme", "online")) for r in auto for k in r)
    ranks = [r for r in on if "rankme_features" in r]
    # at most the rows seen so far (16 a step; the window is 2048) and the dimension (projections: 16)
    assert ranks and all(1.0 <= r["rankme_features"] <= 16 * r["step"] and 1.0 <= r["rankme_projections"] <= 16
                         for r in ranks)
    probe = [r for r in on if "online_linear_top1" in r]
    assert [r["epoch"] for r in probe] == [0, 1]
    assert all(0 <= r["online_linear_top1"] <= 1 and 0 <= r["online_linear_test_top1"] <= 1 for r in probe)
