"""launcher=slurm against a real SLURM (slurmctld + slurmd + munge on localhost, started by .ci/start_slurm.sh):
a 2-task job trains as one run of 2 ranks; stopped by SIGUSR2 (SLURM's warning before pre-emption or the time
limit) and by scontrol requeue (SIGTERM, as scancel sends: a checkpoint, and no requeue of its own), it
checkpoints, requeues, resumes and ends bit-identical to a run never stopped. Without a SLURM here those tests are
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
from helpers import HANG_S, REPO, wait_for

from sslkit.launch.cli import main


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(re.search(r"idle|mixed|allocated", state))


needs_slurm = pytest.mark.skipif(not _slurm_up(), reason="needs a running SLURM (sinfo answers): CI starts one on "
                                 "localhost with .ci/start_slurm.sh")

#: The run's folder, named (its default name would carry the fault hooks of :func:`_pauses`), relative to where the
#: job is submitted from.
FOLDER = "runs/simclr-fashion_mnist"
RUN = ["config=simclr", "machine.device=cpu", "data.batch_size=32", "log.every_n_steps=5", "eval.knn.enabled=false",
       "checkpoint.every_n_epochs=0", "log.tensorboard=false", "log.report=false", "data.num_workers=0",
       f"output_dir={FOLDER}"]
SLURM = ["launcher=slurm", "slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "slurm.time_min=10"]
#: Updates of the run that is requeued twice. It stops at steps 7 and 20, each time inside a step that does not
#: end until the test has sent its signal (fault_block with a release file): the test never races the run.
STEPS = 30


def _pauses(tmp_path: Path, never: bool = False) -> list[str]:
    """The run's two pauses (``never``: the same hooks at steps never reached, for a reference run with the same
    config); the test waits for each pause's marker, signals the job, then creates its release file."""
    hooks = [{"step": 10**6 if never else 7, "once": "true"}, {"step": 10**6 if never else 20, "once": "false"}]
    rendered = ", ".join(f"{{name: fault_block, step: {h['step']}, once: {h['once']}, marker: '{tmp_path}/paused{i}', "
                         f"release: '{tmp_path}/release{i}'}}" for i, h in enumerate(hooks))
    return ["imports=[sslkit_faults]", f"hooks=[{rendered}]"]


def _submit(tmp_path: Path, steps: int) -> tuple[str, Path]:
    """Submit the run from ``tmp_path`` as a user would; the job id and the run folder."""
    from reliability_helpers import FAULT_ENV

    env = {**os.environ, **FAULT_ENV, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "run.py"), *RUN, *SLURM, f"optim.max_steps={steps}",
                           *_pauses(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"submitted SLURM job (\d+): 1 node\(s\) x 2 task\(s\)", proc.stdout)
    assert m, proc.stdout
    assert re.search(r"logs: \S+/slurm/\d+/\d+_0_log\.out", proc.stdout) and "scancel " + m.group(1) in proc.stdout
    return m.group(1), tmp_path / FOLDER


def _job(job: str) -> dict[str, str]:
    """``scontrol show job``'s fields (empty once SLURM forgot the job)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=HANG_S).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(what: str, ok: callable) -> None:  # type: ignore[valid-type]
    wait_for(ok, what)


def _log(run: Path) -> str:
    path = run / "log.txt"
    return path.read_text() if path.exists() else ""


def _restart(job: str, restarts: int) -> None:
    """Wait for the job's requeue number ``restarts``, then let it start again."""
    _wait(f"requeue {restarts}", lambda: _job(job).get("Restarts") == str(restarts) and
          _job(job).get("JobState") == "PENDING")
    # SLURM holds a requeued batch job ~2 minutes before it may start again; start it sooner, as the scheduler
    # (not at once: slurmd refuses a relaunch within seconds of the kill, "Job credential revoked")
    time.sleep(3)  # (a lower bound, SLURM's own: waiting longer is always fine)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True, timeout=HANG_S)


def _job_output(run: Path, job: str) -> str:
    """What the job's tasks printed so far (stdout and stderr of every task, every start)."""
    folder = run / "slurm" / job
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob(f"{job}_*_log.*")))


def _stop_line(log: str, signal: str) -> str:
    """The step of the checkpoint written for ``signal`` (the last one in ``log``)."""
    found = re.findall(rf"saved checkpoint \S+checkpoint_(\d+)\.pt \(pre-emption by {signal}\)", log)
    assert found, log
    return found[-1]


@pytest.mark.multiprocess
@pytest.mark.beside
@needs_slurm
def test_a_job_requeued_twice_mid_training_ends_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    """A 2-task job is stopped twice mid-training: SIGUSR2 (SLURM's warning before pre-emption or the time limit:
    it checkpoints and requeues itself), then ``scontrol requeue`` (SLURM's SIGTERM: it checkpoints, SLURM
    requeues it). Each time it resumes from the checkpoint just written, and its final state equals, bit for bit,
    that of the same run on 2 local processes that was never stopped."""
    from reliability_helpers import assert_identical, latest_state

    ref = tmp_path / "ref"  # trained beside the job (the job mostly waits on SLURM): the numbers do not depend on it
    from reliability_helpers import FAULT_ENV

    env = {**os.environ, **FAULT_ENV, "OMP_NUM_THREADS": "1"}
    reference = subprocess.Popen([sys.executable, str(REPO / "tools" / "run.py"), *RUN, "distributed.nproc_per_node=2",
                                  f"optim.max_steps={STEPS}", *_pauses(tmp_path / "never", never=True),
                                  f"output_dir={ref}"], cwd=tmp_path, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    job, run = _submit(tmp_path, STEPS)
    try:
        script = (run / "slurm" / job / f"{job}_submission.sh").read_text()
        assert "#SBATCH --signal=USR2@120" in script and "#SBATCH --ntasks-per-node=2" in script
        _wait("the pause at step 7", (tmp_path / "paused0").exists)
        assert "global batch 64" in _log(run)  # 2 ranks x 32
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=HANG_S)
        _wait("the signal's arrival", lambda: "SIGUSR2: finishing this step" in _job_output(run, job))
        (tmp_path / "release0").touch()
        _restart(job, 1)
        first = _stop_line(_log(run), "SIGUSR2")
        out = (run / "slurm" / job / f"{job}_0_log.out").read_text()
        assert f"requeueing job {job} (requeue 1 of at most 10)" in out, out
        resumed = f"resumed from {FOLDER}/checkpoints/checkpoint_{first}.pt"
        _wait("the first resume", lambda: resumed in _log(run))
        _wait("the pause at step 20", (tmp_path / "paused1").exists)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=HANG_S)
        _wait("the signal's arrival", lambda: "SIGTERM: finishing this step" in _job_output(run, job))
        (tmp_path / "release1").touch()
        _restart(job, 2)
        second = _stop_line(_log(run), "SIGTERM")
        assert int(first) < int(second) < STEPS, (first, second)
        _wait("the job to end", lambda: _job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", None))
        assert _job(job).get("JobState") == "COMPLETED", _job(job)
        assert f"resumed from {FOLDER}/checkpoints/checkpoint_{second}.pt" in _log(run)
        assert (run / "slurm" / job / f"{job}_0_log.out").read_text().count("requeueing job") == 1  # not on SIGTERM
        assert reference.wait(timeout=HANG_S) == 0, reference.stderr.read() if reference.stderr else ""
        expected, got = latest_state(ref), latest_state(run)
        assert expected["position"]["step"] == got["position"]["step"] == STEPS
        assert_identical(got, expected)
    finally:
        subprocess.run(["scancel", job], timeout=HANG_S)
        if reference.poll() is None:
            reference.kill()


def test_without_sbatch_or_submitit_the_message_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = [*RUN, *SLURM, f"output_dir={tmp_path / 'run'}"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "launcher=slurm needs SLURM's sbatch" in err and "launcher=local" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "pip install 'sslkit[slurm]'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_credentials_on_the_command_line_are_refused_before_submitit_writes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """submitit pickles the command into the run folder: a data.storage_options secret on it stops the submission,
    naming the environment variables to use, and nothing is written."""
    args = [*RUN, *SLURM, "data.storage_options.secret=hush-42", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "gives credentials in data.storage_options" in err and "AWS_SECRET_ACCESS_KEY" in err
    assert "hush-42" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
