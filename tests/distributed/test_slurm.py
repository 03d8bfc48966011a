"""launcher=slurm against a real SLURM (slurmctld + slurmd + munge on localhost, started by .ci/start_slurm.sh):
a 2-task job trains as one run of 2 ranks; SIGUSR2 (SLURM's warning before pre-emption or the time limit)
checkpoints, requeues and resumes; scancel checkpoints and stays cancelled. Without a SLURM here those tests are
skipped; the messages for a machine without sbatch or submitit are tested everywhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO

from sslkit.cli import main


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(re.search(r"idle|mixed|allocated", state))


needs_slurm = pytest.mark.skipif(not _slurm_up(), reason="needs a running SLURM (sinfo answers): CI starts one on "
                                 "localhost with .ci/start_slurm.sh")

RUN = ["config=simclr", "launcher=slurm", "machine.device=cpu", "slurm.tasks_per_node=2", "slurm.cpus_per_task=1",
       "slurm.time_min=10", "data.batch_size=32", "optim.max_steps=1000", "log.every_n_steps=5",
       "eval.knn.enabled=false", "checkpoint.every_n_epochs=0", "log.tensorboard=false", "log.report=false",
       "data.num_workers=0"]


def _submit(tmp_path: Path) -> tuple[str, Path]:
    """Submit RUN from ``tmp_path`` as a user would; the job id and the run folder."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "run.py"), *RUN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"submitted SLURM job (\d+): 1 node\(s\) x 2 task\(s\)", proc.stdout)
    assert m, proc.stdout
    assert re.search(r"logs: \S+/slurm/\d+/\d+_0_log\.out", proc.stdout) and "scancel " + m.group(1) in proc.stdout
    return m.group(1), tmp_path / "runs" / "simclr-fashion_mnist"


def _job(job: str) -> dict[str, str]:
    """``scontrol show job``'s fields (empty once SLURM forgot the job)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(what: str, ok: callable, timeout: float = 120.0) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.5)


def _log(run: Path) -> str:
    path = run / "log.txt"
    return path.read_text() if path.exists() else ""


@pytest.mark.multiprocess
@needs_slurm
def test_a_job_trains_as_two_ranks_sigusr2_requeues_it_and_scancel_ends_it(tmp_path: Path) -> None:
    """One job of 2 tasks: SIGUSR2 checkpoints, requeues and the job resumes from that checkpoint; then scancel
    (SIGTERM) checkpoints again and the job stays cancelled (not requeued a second time)."""
    job, run = _submit(tmp_path)
    try:
        script = (run / "slurm" / job / f"{job}_submission.sh").read_text()
        assert "#SBATCH --signal=USR2@120" in script and "#SBATCH --ntasks-per-node=2" in script
        _wait("a first step", lambda: re.search(r"step \d+/", _log(run)) is not None)
        assert "global batch 64" in _log(run)  # 2 ranks x 32
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        _wait("the requeue", lambda: _job(job).get("Restarts") == "1" and _job(job).get("JobState") == "PENDING")
        stopped = re.search(r"saved checkpoint \S+checkpoint_(\d+)\.pt \(pre-emption by SIGUSR2\)", _log(run))
        assert stopped, _log(run)
        out = (run / "slurm" / job / f"{job}_0_log.out").read_text()
        assert f"requeueing job {job} (requeue 1 of at most 10)" in out, out
        # SLURM holds a requeued batch job ~2 minutes before it may start again; start it sooner, as the scheduler
        # (not at once: slurmd refuses a relaunch within seconds of the kill, "Job credential revoked")
        time.sleep(5)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, timeout=30)
        resumed = f"resumed from runs/simclr-fashion_mnist/checkpoints/checkpoint_{stopped.group(1)}.pt"
        _wait("the resume", lambda: resumed in _log(run))
        _wait("a step after it", lambda: re.search(r"step \d+/", _log(run).split(resumed)[1]) is not None)
        subprocess.run(["scancel", job], check=True, timeout=30)
        _wait("the job to end", lambda: _job(job).get("JobState") in ("CANCELLED", "COMPLETED", "FAILED", None))
        _wait("the SIGTERM checkpoint", lambda: re.search(r"saved checkpoint \S+ \(pre-emption by SIGTERM\)",
                                                         _log(run).split(resumed)[1]) is not None, timeout=30)
        assert _job(job).get("JobState") == "CANCELLED" and _job(job).get("Restarts") == "1", _job(job)
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_without_sbatch_or_submitit_the_message_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = [*RUN, f"output_dir={tmp_path / 'run'}"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "launcher=slurm needs SLURM's sbatch" in err and "launcher=local" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "pip install 'sslkit[slurm]'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing written
