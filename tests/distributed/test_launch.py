"""tools/run.py with distributed.nproc_per_node=2 and under torchrun; a failing worker stops the run."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import forkrun
import pytest
import torch
from helpers import HANG_S, REPO, SMALL, metrics, run_cli, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

DIST = [*SMALL, "data.train.kwargs.num_samples=128", "optim.max_steps=4", "log.every_n_steps=1",
        "distributed.consistency_check_every_n_steps=2"]


def check_run(out: Path) -> None:
    steps = [r["step"] for r in metrics(out) if r.get("phase") == "train"]
    assert steps == [1, 2, 3, 4]  # rank 0 alone writes: one record per step, not two
    state = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest.txt").read_text(), weights_only=False)
    assert state["position"]["step"] == 4
    assert state["position"]["samples"] == 4 * 16 * 2  # global batch = 2 ranks x 16
    assert any("knn_top1" in r for r in metrics(out))


def test_run_spawns_two_workers(tmp_path: Path) -> None:
    out = tmp_path / "spawn"
    proc = run_cli("config=simclr", *DIST, "distributed.nproc_per_node=2", f"output_dir={out}")
    assert "global batch 32" in proc.stdout
    check_run(out)


def test_run_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "torchrun"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # torchrun's agent forked from the tests' server (torch imported); it starts its ranks as new interpreters
    proc = forkrun.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2",
         str(REPO / "tools" / "run.py"), "config=simclr", *DIST, f"output_dir={out}"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_run(out)


FAILING = '''
from sslkit.hooks.base import SSLHook
from sslkit.registry import register_hook

@register_hook("fail_on_rank1")
class FailOnRank1(SSLHook):
    def on_update(self, task):
        if task.rank == 1 and task.clock.step == 1:
            raise RuntimeError("injected failure on rank 1")
'''


def test_failing_worker_stops_the_whole_run(tmp_path: Path) -> None:
    (tmp_path / "failing_plugin.py").write_text(textwrap.dedent(FAILING))
    proc = run_cli("config=simclr", *DIST, "distributed.nproc_per_node=2", "distributed.timeout_s=60",
                   "imports=[failing_plugin]", "hooks=[{name: fail_on_rank1}]", f"output_dir={tmp_path / 'run'}",
                   cwd=tmp_path, check=False)
    assert proc.returncode != 0
    # The cause is printed by the failing worker itself, first, whichever worker's error the parent
    # re-raises (often rank 0's "remote worker crashed" echo of it, depending on which exits first).
    header = "sslkit: worker of rank 1 failed:"
    assert header in proc.stderr, proc.stderr[-3000:]
    assert "injected failure on rank 1" in proc.stderr.split(header, 1)[1].split("sslkit: worker of rank", 1)[0]
    assert "a worker failed, so all workers were stopped" in proc.stderr  # (and not hung: run_cli's guard)


def _report(index: int, tag: str) -> None:
    """Say what a started process sees: its index, an environment variable, its folder, and a module path."""
    print(f"{tag} {index} env={os.environ.get('SSLKIT_TEST_MARK')} cwd={os.getcwd()} "
          f"path={'/sslkit-test-path' in sys.path}", flush=True)
    print(f"{tag} {index} on stderr", file=sys.stderr, flush=True)


def test_started_processes_see_the_parents_state_at_each_start_not_the_fork_servers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server starts once, on the first call; a later call's processes still see the environment,
    folder, sys.path and stdout/stderr of that later moment (a spawned process would, and a test's or a
    launcher's changes in between must reach them)."""
    from sslkit.distributed import start_processes

    start_processes(_report, ("first",), 1)
    monkeypatch.setenv("SSLKIT_TEST_MARK", "set-after")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("/sslkit-test-path")
    files = {fd: tmp_path / f"fd{fd}.txt" for fd in (1, 2)}
    saved = {fd: os.dup(fd) for fd in files}
    try:
        for fd, path in files.items():  # where this process's stdout and stderr go now
            with path.open("wb") as f:
                os.dup2(f.fileno(), fd)
        start_processes(_report, ("second",), 2)
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
    out, err = files[1].read_text(), files[2].read_text()
    for i in (0, 1):
        assert f"second {i} env=set-after cwd={tmp_path} path=True" in out, out
        assert f"second {i} on stderr" in err, err


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _fails_at_once_but_rank_0_later(pid_file: str) -> None:
    if os.environ["RANK"] == "1":
        Path(pid_file).write_text(str(os.getpid()))
        raise SystemExit(2)  # a user error: this rank exits quietly, rank 0 says it
    wait_for(lambda: Path(pid_file).exists() and _exited(int(Path(pid_file).read_text() or 0)), "rank 1's exit")
    print("rank 0 says what is wrong", file=sys.stderr, flush=True)
    raise SystemExit(2)


def test_a_rank_that_stops_first_does_not_cut_off_rank_0s_message(capfd: pytest.CaptureFixture,
                                                                   tmp_path: Path) -> None:
    """The same error reaches every rank; when rank 1 exits first, rank 0 still gets to say it (the launcher gives
    the others a grace period instead of stopping them at once)."""
    from torch.multiprocessing import ProcessExitedException

    from sslkit.distributed import launch

    with pytest.raises(ProcessExitedException):
        launch(_fails_at_once_but_rank_0_later, (str(tmp_path / "rank1.pid"),), nproc_per_node=2, backend="gloo",
               device="cpu")
    assert "rank 0 says what is wrong" in capfd.readouterr().err
