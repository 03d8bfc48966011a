"""Pre-emption: SIGTERM / SIGUSR1 finish the step, write a checkpoint, exit 75; the same command resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkrun
import pytest
from helpers import HANG_S, REPO, metrics, run_cli, run_main, wait_for
from reliability_helpers import BASE, FAULT_ENV, assert_identical, hooks_override, latest_state, run_ranks_main

from sslkit.errors import PREEMPTED_EXIT_CODE

ARGS = ["config=simclr", *BASE, "optim.epochs=2"]  # 12 steps, checkpoints only at epoch ends


def _reference(tmp_path: Path, nproc: int = 1) -> dict:
    """The uninterrupted run's final state (one process: in this process, through sslkit.launch.cli.main)."""
    out = tmp_path / "ref"
    never = hooks_override("simclr", {"name": "fault_signal", "step": 10**6})
    args = [*ARGS, f"distributed.nproc_per_node={nproc}", f"data.batch_size={16 // nproc}", never, f"output_dir={out}"]
    if nproc == 1:
        run_main(*args)
    else:  # processes this test spawns, without the launcher's interpreter
        assert run_ranks_main(nproc, tmp_path / "ref-ranks", *args).returncode == 0
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
    assert (position["step"], position["phase_idx"], position["step_in_epoch"]) == (9, 1, 3)
    assert max(r["step"] for r in metrics(out) if r.get("phase") == "train") <= 9

    if sig == "SIGTERM":  # the resume is the same whichever signal stopped the run: check it once
        second = run_main(*ARGS, hooks, f"output_dir={out}")  # the fault fires in a fresh run only (once)
        assert "checkpoint_000000009.pt" in second.stdout
        assert_identical(latest_state(out), _reference(tmp_path))


def _start(out: Path, nproc: int, *extra: str, stderr: Path | None = None) -> forkrun.ForkedProcess:
    """A long run in its own process group (as a terminal or a scheduler starts it); its stderr to a pipe, or to the
    file ``stderr`` (for a test that reads it while the run goes on)."""
    args = ["config=simclr", *BASE, "optim.epochs=40", "log.every_n_steps=1", f"output_dir={out}",
            f"distributed.nproc_per_node={nproc}", f"data.batch_size={16 // nproc}", *extra]
    env = {**os.environ, **FAULT_ENV}
    err = stderr.open("w") if stderr is not None else subprocess.PIPE
    return forkrun.popen([sys.executable, str(REPO / "tools" / "run.py"), *args], cwd=REPO, env=env,  # type: ignore[return-value]
                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)


def _wait_for_steps(out: Path, steps: int, proc: subprocess.Popen[str]) -> None:
    log = out / "metrics.jsonl"
    wait_for(lambda: log.exists() and log.read_text().count("\n") >= steps, f"{steps} logged steps", proc)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "to", "nproc", "workers"), [
    # SIGTERM to the main process of 1: test_signal_checkpoints_after_the_step_and_the_same_command_resumes
    pytest.param("SIGTERM", "main", 2, 0, marks=pytest.mark.multiprocess),
    ("SIGTERM", "group", 1, 2),  # a scheduler: the loader workers get it too, and must not die of it
    ("SIGINT", "group", 1, 2),  # a terminal's Ctrl-C
    pytest.param("SIGINT", "group", 2, 1, marks=pytest.mark.multiprocess),
])
def test_external_signal_at_an_arbitrary_moment(tmp_path: Path, sig: str, to: str, nproc: int, workers: int) -> None:
    """The signal comes from outside, whenever the run has made some progress: to the main process alone
    (with 2 processes, the launching parent passes it on) or to the whole process group, loader workers
    and ranks included. Each time the step finishes, a checkpoint is written, and the exit status is 75."""
    out = tmp_path / "run"
    proc = _start(out, nproc, f"data.num_workers={workers}")
    _wait_for_steps(out, 8, proc)
    if to == "group":
        os.killpg(proc.pid, getattr(signal, sig))
    else:
        proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "Traceback" not in err and "DataLoader worker" not in err
    stopped = latest_state(out)["position"]["step"]
    assert 8 <= stopped < 240
    assert f"stopped by {sig} after step {stopped}" in err if nproc == 1 else "pre-empted" in err
    if sig == "SIGINT" and nproc == 1:
        assert "Ctrl-C again to stop at once" in err


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    """Step 3 does not end by itself (fault_block): the first Ctrl-C asks for a checkpoint after the step; a second
    one, once the first was acted on and more than PreemptionHook.REPEAT_S later (one press that reaches the
    process twice is one), stops at once (exit 130, no checkpoint of that step) with a message, not a traceback;
    the last checkpoint stays."""
    from sslkit.hooks.preemption import PreemptionHook

    out, marker, err_file = tmp_path / "run", tmp_path / "in-step-3", tmp_path / "stderr.txt"
    proc = _start(out, 1, "checkpoint.every_n_steps=2", f"hooks=[{{name: fault_block, step: 3, marker: '{marker}'}}]",
                  stderr=err_file)
    wait_for(marker.exists, "step 3", proc)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: "finishing this step" in err_file.read_text(), "the first Ctrl-C's message", proc)
    time.sleep(2 * PreemptionHook.REPEAT_S)  # (at least this long: a second press, not the same one)
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=HANG_S)
    err = err_file.read_text()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at once" in err and "Traceback" not in err
    assert latest_state(out)["position"]["step"] == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_signal_to_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    hooks = hooks_override("simclr", {"name": "fault_signal", "step": 9, "signal": "SIGUSR1", "rank": 1})
    args = [*ARGS, "distributed.nproc_per_node=2", "data.batch_size=8", hooks, f"output_dir={out}"]
    first = run_cli(*args, env=FAULT_ENV, check=False)
    assert first.returncode == PREEMPTED_EXIT_CODE, first.stderr[-3000:]
    state = latest_state(out)
    assert state["position"]["step"] == 9 and len(state["rng"]) == 2
    assert run_ranks_main(2, tmp_path / "resume-ranks", *args).returncode == 0
    assert_identical(latest_state(out), _reference(tmp_path, nproc=2))


@pytest.mark.slow
def test_ctrl_c_through_a_pipe_whose_reader_dies_still_checkpoints(tmp_path: Path) -> None:
    """``python tools/run.py ... 2>&1 | tee log`` and Ctrl-C: the reader, in the same process group, dies of the
    SIGINT first, and everything the run writes afterwards meets a closed pipe. The run still finishes the step,
    writes its checkpoint and exits 75 (its log.txt says so). Step 3 does not end by itself (fault_block) until the
    reader is gone, so the checkpoint's writes and messages come after the pipe closed, however fast the machine."""
    import shlex

    out, marker, release = tmp_path / "run", tmp_path / "in-step-3", tmp_path / "release"
    reader_pid, code = tmp_path / "reader.pid", tmp_path / "code"
    args = ["config=simclr", *BASE, "optim.epochs=40", "log.every_n_steps=1", f"output_dir={out}",
            f"hooks=[{{name: fault_block, step: 3, marker: '{marker}', release: '{release}'}}]"]
    run = " ".join(shlex.quote(a) for a in [sys.executable, str(REPO / "tools" / "run.py"), *args])
    reader = f"sh -c 'echo $$ > {reader_pid}; exec cat > {tmp_path / 'reader.txt'}'"
    # (SIGINT back to its default first: a pytest-xdist worker ignores it, and an ignored signal stays ignored in
    # every program started below, the reader included, as it never is under a terminal's shell)
    shell = subprocess.Popen(["bash", "-c", f"{run} 2>&1 | {reader}; echo ${{PIPESTATUS[0]}} > {code}"], cwd=REPO,
                             env={**os.environ, **FAULT_ENV}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(marker.exists, "step 3", shell)
        os.killpg(shell.pid, signal.SIGINT)  # a terminal's Ctrl-C: the run, the reader and the shell
        pid = int(reader_pid.read_text())
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the reader's death", shell)
        release.touch()
        shell.wait(timeout=HANG_S)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert "training" in (tmp_path / "reader.txt").read_text()  # the pipe carried the output until then
    log = (out / "log.txt").read_text()
    assert int(code.read_text()) == PREEMPTED_EXIT_CODE, log[-2000:]
    assert latest_state(out)["position"]["step"] == 3
    assert "received SIGINT: writing a checkpoint after step 3" in log and "(pre-emption by SIGINT)" in log
