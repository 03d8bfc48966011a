"""Non-finite loss (halt / skip) and out-of-memory (halt / skip) policies, injected into real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import metrics, run_cli, run_main
from reliability_helpers import BASE, FAULT_ENV, RECIPE_ARGS, hooks_override, latest_state

ARGS = ["config=simclr", *BASE, "optim.epochs=2", "log.every_n_steps=4", "checkpoint.every_n_steps=2"]


def _finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@pytest.mark.slow
def test_nan_halt_names_step_terms_and_samples_and_keeps_checkpoints_clean(tmp_path: Path) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_nan", "step": 5})
    proc = run_main(*ARGS, hooks, f"output_dir={out}", check=False)
    assert proc.returncode == 1
    err = proc.stderr
    assert "step 5: the loss is not finite (loss=nan" in err
    assert "data_idx" in err and "reliability.nonfinite_loss=skip" in err
    # the indices named are those of step 5's batch: the 5th batch of epoch 0 in the sampler's order
    named = json.loads(err.split("on this rank: ")[1].split("]")[0] + "]")
    assert len(named) == 16
    # detected at the log interval (step 8 at the latest), with no checkpoint written after step 4
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("checkpoint_*.pt"))
    assert ckpts == ["checkpoint_000000002.pt", "checkpoint_000000004.pt"]
    assert _finite(latest_state(out))
    crash = sorted((out / "checkpoints").glob("crash_*.pt"))
    assert len(crash) == 1 and "crash_" in err and "checkpoint_000000004.pt" in err
    assert "step 5" in torch.load(crash[0], weights_only=False)["crash"]
    # nothing of step 5 onwards reached the optimizer's result in the clean checkpoint; the same command resumes
    # at 4 (the fault fires only in a run started from scratch)
    again = run_main(*ARGS, hooks, f"output_dir={out}")
    assert "checkpoint_000000004.pt" in again.stdout
    assert latest_state(out)["position"]["step"] == 12 and _finite(latest_state(out))


@pytest.mark.slow
def test_nan_skip_drops_that_update_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_nan", "step": 5})
    proc = run_main(*ARGS, "reliability.nonfinite_loss=skip", hooks, f"output_dir={out}")
    assert "step 5: the loss is not finite" in proc.stdout + proc.stderr
    final = latest_state(out)
    assert _finite(final)
    assert final["position"]["step"] == 12
    assert final["position"]["skipped_steps"] == {"non-finite loss": 1}
    assert final["position"]["samples"] == 11 * 16
    assert all(torch.isfinite(v).all() for k, v in final["model"].items() if "running" in k)
    logged = {r["step"]: r for r in metrics(out) if r.get("phase") == "train"}
    assert 12 in logged


@pytest.mark.slow
def test_nan_skip_stops_after_consecutive_skips(tmp_path: Path) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", *[{"name": "fault_nan", "step": s} for s in (3, 4, 5)])
    proc = run_main(*ARGS, "reliability.nonfinite_loss=skip", "reliability.max_consecutive_skips=3", hooks,
                   f"output_dir={out}", check=False)
    assert proc.returncode == 1
    assert "3 updates in a row were dropped (non-finite loss)" in proc.stderr
    # the checkpoint of step 4 came after two dropped updates: its weights are those of step 2's update
    last = latest_state(out)
    assert last["position"]["step"] == 4 and last["position"]["skipped_steps"] == {"non-finite loss": 2}
    assert _finite(last)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_halt_says_what_to_do(tmp_path: Path, where: str) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_oom", "step": 3, "where": where})
    proc = run_main(*ARGS, hooks, f"output_dir={out}", check=False)
    assert proc.returncode == 1
    assert "step 3: out of memory" in proc.stderr and "Lower data.batch_size" in proc.stderr
    assert latest_state(out)["position"]["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_skip_drops_the_step_and_continues(tmp_path: Path, where: str) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_oom", "step": 3, "where": where})
    run_main(*ARGS, "reliability.oom=skip", hooks, f"output_dir={out}")
    final = latest_state(out)
    assert final["position"]["step"] == 12 and final["position"]["skipped_steps"] == {"out of memory": 1}
    assert final["position"]["samples"] == 11 * 16 and _finite(final)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_oom_skip_on_one_rank_skips_the_step_on_both(tmp_path: Path) -> None:
    """Rank 1 runs out of memory in backward; rank 0's backward succeeds; both drop step 3 and go on
    in step (the consistency check compares their parameters every step). MoCo: its collectives
    (shuffle-BN, the key gather) are in the forward, none in the backward (docs/reliability.md)."""
    out = tmp_path / "run"
    hooks = hooks_override("moco", {"name": "fault_oom", "step": 3, "where": "backward", "rank": 1})
    args = ["config=moco", *BASE, *RECIPE_ARGS["moco"], "optim.epochs=2", "checkpoint.every_n_steps=2"]
    proc = run_cli(*args, "distributed.nproc_per_node=2", "data.batch_size=8", "reliability.oom=skip",
                   "distributed.consistency_check_every_n_steps=1", hooks, f"output_dir={out}", env=FAULT_ENV)
    assert "manual_gradient_reduction" in proc.stdout
    final = latest_state(out)
    assert final["position"]["step"] == 12 and final["position"]["skipped_steps"] == {"out of memory": 1}
    assert final["position"]["samples"] == 11 * 16
