"""Pre-emption: SIGTERM / SIGUSR1 finish the step, write a checkpoint, exit 75; the same command resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, metrics, run_cli
from reliability_helpers import BASE, FAULT_ENV, assert_identical, hooks_override, latest_state

from sslkit.reliability import PREEMPTED_EXIT_CODE

ARGS = ["config=simclr", *BASE, "optim.epochs=2"]  # 12 steps, checkpoints only at epoch ends


def _reference(tmp_path: Path, nproc: int = 1) -> dict:
    out = tmp_path / "ref"
    never = hooks_override("simclr", {"name": "fault_signal", "step": 10**6})
    run_cli(*ARGS, f"distributed.nproc_per_node={nproc}", f"data.batch_size={16 // nproc}", never,
            f"output_dir={out}", env=FAULT_ENV)
    return latest_state(out)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_signal_checkpoints_after_the_step_and_the_same_command_resumes(tmp_path: Path, sig: str) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_signal", "step": 9, "signal": sig})
    first = run_cli(*ARGS, hooks, f"output_dir={out}", env=FAULT_ENV, check=False)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-2000:]
    assert f"stopped by {sig} after step 9" in first.stderr
    assert "Run the same command again to resume" in first.stderr
    state = latest_state(out)
    # the step in progress was finished and checkpointed mid-epoch (epoch 1, 3 of 6 steps)
    position = state["position"]
    assert (position["iteration"], position["phase_idx"], position["steps_in_phase"]) == (9, 1, 3)
    assert max(r["step"] for r in metrics(out) if r.get("phase") == "train") <= 9

    if sig == "SIGTERM":  # the resume is the same whichever signal stopped the run: check it once
        second = run_cli(*ARGS, hooks, f"output_dir={out}", env=FAULT_ENV)
        assert "checkpoint_000000009.pt" in second.stdout
        assert_identical(latest_state(out), _reference(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_external_sigterm_at_an_arbitrary_moment(tmp_path: Path, nproc: int) -> None:
    """The signal comes from outside, whenever the run has made some progress; with 2 processes it
    goes to the launching parent, which passes it on to its workers."""
    out = tmp_path / "run"
    args = ["config=simclr", *BASE, "optim.epochs=40", "log.every_n_steps=1", f"output_dir={out}",
            f"distributed.nproc_per_node={nproc}", f"data.batch_size={16 // nproc}"]
    env = {**os.environ, **FAULT_ENV}
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "run.py"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    log = out / "metrics.jsonl"
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 8):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    stopped = latest_state(out)["position"]["iteration"]
    assert 8 <= stopped < 240
    assert f"after step {stopped}" in err if nproc == 1 else "pre-empted" in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_signal_to_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_signal", "step": 9, "signal": "SIGUSR1", "rank": 1})
    args = [*ARGS, "distributed.nproc_per_node=2", "data.batch_size=8", hooks, f"output_dir={out}"]
    first = run_cli(*args, env=FAULT_ENV, check=False)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    state = latest_state(out)
    assert state["position"]["iteration"] == 9 and len(state["rng"]) == 2
    run_cli(*args, env=FAULT_ENV)
    assert_identical(latest_state(out), _reference(tmp_path, nproc=2))
