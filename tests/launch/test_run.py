"""tools/run.py end to end on synthetic data: every output, user plugins through imports, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import forkrun
import pytest
import torch
from helpers import REPO, SMALL, metrics, run_cli, run_main, wait_for


@pytest.mark.slow
def test_run_writes_every_output(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("config=simclr", *SMALL, "optim.epochs=2", f"output_dir={out}")
    assert (out / "config.yaml").is_file() and "nt_xent" in (out / "config.yaml").read_text()
    assert "loss" in (out / "log.txt").read_text()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest.txt").is_file()
    records = metrics(out)
    train = [r for r in records if r.get("phase") == "train"]
    assert {"step", "epoch", "loss", "lr", "img_per_s"} <= set(train[0])
    assert train[-1]["step"] == 8  # 64 samples / 16 = 4 steps x 2 epochs
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    knn = [r for r in records if "knn_top1" in r]
    assert len(knn) == 1 and 0.0 <= knn[0]["knn_top1"] <= 1.0
    assert "knn_top1" in proc.stdout
    state = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest.txt").read_text(), weights_only=False)
    assert state["position"] == {"phase_idx": 2, "step_in_epoch": 0, "step": 8, "samples": 128,
                                 "skipped_steps": {}, "consecutive_skips": 0, "stage": "base"}
    assert state["hooks"]["knn"]["done"] is True
    # each checkpoint is logged once; the last epoch's is updated once with the kNN results of the end of the run
    saves = [line.split("] ", 1)[1] for line in (out / "log.txt").read_text().splitlines() if "checkpoint_0" in line]
    assert [s.rsplit("/", 1)[1] for s in saves] == [
        "checkpoint_000000004.pt (end of epoch 0)", "checkpoint_000000008.pt (end of epoch 1)",
        "checkpoint_000000008.pt (updated at the end of the run with the state of knn)"]

    # Running the same command again finds the finished run and redoes nothing, not even a save.
    again = run_main("config=simclr", *SMALL, "optim.epochs=2", f"output_dir={out}")  # (no process of its own)
    assert "resumed from" in again.stdout and "kNN already evaluated" in again.stdout
    assert "saved checkpoint" not in again.stdout
    assert len(metrics(out)) == len(records)


def test_config_error_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never"
    proc = run_main("optim.lrr=0.1", f"output_dir={out}", check=False)
    assert proc.returncode == 2
    assert "Did you mean 'optim.lr'" in proc.stderr
    assert not out.exists()


PLUGIN = '''
from sslkit.hooks.base import SSLHook
from sslkit.registry import register_hook, register_train_step
from sslkit.train_steps.standard import standard_train_step

CALLS = {"steps": 0}

@register_train_step("counting_step")
def counting_step(task):
    CALLS["steps"] += 1
    standard_train_step(task)

@register_hook("marker")
class MarkerHook(SSLHook):
    name = "marker"

    def __init__(self, path: str, tag: str = "x"):
        self.path, self.tag = path, tag

    def on_end(self, task):
        with open(self.path, "w") as f:
            f.write(f"{self.tag} steps={CALLS['steps']} step={task.clock.step}")
'''


@pytest.mark.slow
def test_custom_train_step_and_hook_from_imports(tmp_path: Path) -> None:
    (tmp_path / "my_plugin.py").write_text(textwrap.dedent(PLUGIN))
    marker = tmp_path / "marker.txt"
    run_cli("config=simclr", *SMALL, "optim.max_steps=3", "eval.knn.enabled=false", "imports=[my_plugin]",
            "train_step=counting_step", f"hooks=[{{name: marker, path: '{marker}', tag: hello}}]",
            f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert marker.read_text() == "hello steps=3 step=3"


@pytest.mark.slow
def test_resume_after_kill_continues_from_saved_step(tmp_path: Path) -> None:
    """SIGKILL from outside once a checkpoint of step 8 is there, at whatever step the run has reached by then
    (step 13 does not end by itself in the first run, fault_block: the kill always comes before the end)."""
    from reliability_helpers import FAULT_ENV

    out = tmp_path / "run"
    args = ["config=simclr", *SMALL, "data.train.kwargs.num_samples=256", "optim.epochs=3",
            "checkpoint.every_n_steps=4", "eval.knn.enabled=false", "log.every_n_steps=1",
            "checkpoint.keep_last=0", "imports=[sslkit_faults]",
            f"hooks=[{{name: fault_block, step: 13, marker: '{tmp_path / 'in-step-13'}'}}]", f"output_dir={out}"]
    env = {**os.environ, **FAULT_ENV}
    proc = forkrun.popen([sys.executable, str(REPO / "tools" / "run.py"), *args], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpts = out / "checkpoints"
    latest = ckpts / "latest.txt"
    wait_for(lambda: latest.exists() and latest.read_text() >= "checkpoint_000000008.pt", "step 8's checkpoint",
             proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    resumed_at = saved["position"]["step"]
    assert 8 <= resumed_at <= 12
    logged = [r["step"] for r in metrics(out) if r.get("phase") == "train"]
    killed_past_checkpoint = max(logged) > resumed_at  # the kill came after a step was logged

    again = run_main(*args)  # the resume needs no process of its own
    assert f"step {resumed_at} of the run" in again.stdout
    assert ("dropped" in again.stdout) == killed_past_checkpoint
    # the records of the steps past the checkpoint were dropped and logged again: every step once
    steps = [r["step"] for r in metrics(out) if r.get("phase") == "train"]
    assert steps == list(range(1, 49))
    final = torch.load(ckpts / (ckpts / "latest.txt").read_text(), weights_only=False)
    assert final["position"]["step"] == 48
