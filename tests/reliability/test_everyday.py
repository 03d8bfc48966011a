"""Everyday use that must never mislead or lose work: one config per run folder, lengthened runs, every recipe's
exact resume, and the failures a user can cause ending in a message (in-process through ``sslkit.launch.cli.main``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from helpers import RECIPES, SMALL, metrics
from reliability_helpers import _render, assert_identical, latest_state

from sslkit.launch.cli import main
from sslkit.launch.runfolder import config_changes

QUICK = [*SMALL, "log.tensorboard=false", "optim.max_steps=4", "eval.knn.k=5"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------- one config per folder
def test_config_changes_ignore_operational_keys_and_sort_lengthening() -> None:
    saved = {"optim": {"lr": 0.3, "epochs": 2, "max_steps": 4}, "log": {"every_n_steps": 50},
             "data": {"num_workers": 2, "batch_size": 256}, "output_dir": "a", "eval": {"knn": {"k": 200}}}
    now = {"optim": {"lr": 0.01, "epochs": 3, "max_steps": 2}, "log": {"every_n_steps": 10},
           "data": {"num_workers": 8, "batch_size": 256}, "output_dir": "b", "eval": {"knn": {"k": 20}}}
    lengthened, changed = config_changes(saved, now)
    assert lengthened == [("optim.epochs", 2, 3)]
    assert changed == [("optim.lr", 0.3, 0.01), ("optim.max_steps", 4, 2)]  # fewer steps is not a lengthening
    assert config_changes({"optim": {"max_steps": 4}}, {"optim": {"max_steps": 0}})[0] == [("optim.max_steps", 4, 0)]
    assert config_changes({"a": 1}, {"a": 1, "b": 2})[1] == [("b", "<absent>", 2)]


def test_with_a_global_batch_the_number_of_processes_may_change_on_a_resume() -> None:
    """data.global_batch_size fixes what a step computes: the processes, the strategy and the split into
    micro-batches may change (elastic resume); without it a different number of processes is a different run."""
    saved = {"data": {"global_batch_size": 256, "batch_size": 128}, "distributed": {"nproc_per_node": 2,
             "strategy": "ddp"}, "optim": {"micro_batches": 1}}
    now = {"data": {"global_batch_size": 256, "batch_size": 64}, "distributed": {"nproc_per_node": 4,
           "strategy": "fsdp"}, "optim": {"micro_batches": 2}}
    assert config_changes(saved, now) == ([], [])
    saved["data"]["global_batch_size"] = now["data"]["global_batch_size"] = 0
    assert [key for key, _, _ in config_changes(saved, now)[1]] == [
        "data.batch_size", "distributed.nproc_per_node", "distributed.strategy", "optim.micro_batches"]


def test_changed_config_does_not_resume_and_names_each_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert _run(capsys, "config=simclr", *QUICK, f"output_dir={out}")[0] == 0
    saved_config = (out / "config.yaml").read_text()
    records = (out / "metrics.jsonl").read_text()

    code, _, err = _run(capsys, "config=simclr", *QUICK, "optim.lr=0.01", "model.head.out_dim=8", f"output_dir={out}")
    assert code == 2
    assert "optim.lr: 0.3 (saved) -> 0.01 (now)" in err
    assert "model.head.out_dim: 16 (saved) -> 8 (now)" in err
    for way_out in ("output_dir=", "checkpoint.auto_resume=false", "checkpoint.resume_changed_config=true"):
        assert way_out in err
    assert "Traceback" not in err
    # nothing in the folder changed: the config still says what the checkpoints are
    assert (out / "config.yaml").read_text() == saved_config
    assert (out / "metrics.jsonl").read_text() == records

    # operational keys (workers, logging) resume without a word; the explicit override continues anyway
    assert _run(capsys, "config=simclr", *QUICK, "log.every_n_steps=1", f"output_dir={out}")[0] == 0
    code, stdout, _ = _run(capsys, "config=simclr", *QUICK, "optim.lr=0.01", "checkpoint.resume_changed_config=true",
                           f"output_dir={out}")
    assert code == 0 and "resuming with a changed config" in stdout and "optim.lr 0.3 -> 0.01" in stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["lr"] == 0.01


def test_lengthened_run_trains_on_and_evaluates_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """max_steps 4 -> 8 inside one epoch (8 steps of 8 samples): the run trains steps 5-8 from the very position
    it stopped at, and kNN is computed again for step 8 (the step-4 result is not reported as the run's)."""
    out = tmp_path / "run"
    args = ["config=simclr", *QUICK, "data.batch_size=8", f"output_dir={out}"]
    assert _run(capsys, *args)[0] == 0
    position = latest_state(out)["position"]  # cut by max_steps: the position stays inside the epoch
    assert (position["phase_idx"], position["step_in_epoch"], position["step"]) == (0, 4, 4)

    code, stdout, _ = _run(capsys, *args, "optim.max_steps=8")
    assert code == 0
    assert "the run is lengthened: optim.max_steps 4 -> 8" in stdout
    assert "step 8/8" in stdout and "kNN at step 8" in stdout
    state = latest_state(out)
    assert state["position"]["step"] == 8 and state["hooks"]["knn"]["step"] == 8
    knn = [r for r in metrics(out) if "knn_top1" in r]
    assert [r["step"] for r in knn] == [4, 8]  # every result is tied to the step it was computed at

    # the same command again: nothing to train, and the stored result is the one of step 8
    code, stdout, _ = _run(capsys, *args, "optim.max_steps=8")
    assert code == 0 and "kNN already evaluated for this run at step 8" in stdout
    # raising the epochs of an epoch-bounded run trains the new epoch and evaluates again
    epochs = ["config=simclr", *QUICK[:-2], "optim.epochs=1", "eval.knn.k=5", f"output_dir={tmp_path / 'e'}"]
    assert _run(capsys, *epochs)[0] == 0
    code, stdout, _ = _run(capsys, *epochs[:-2], "optim.epochs=2", "eval.knn.k=5", f"output_dir={tmp_path / 'e'}")
    assert code == 0 and "optim.epochs 1 -> 2" in stdout and "kNN at step 8" in stdout


def test_fresh_start_moves_the_older_run_aside(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert _run(capsys, "config=simclr", *QUICK, f"output_dir={out}")[0] == 0
    old_records = (out / "metrics.jsonl").read_text()
    code, stdout, _ = _run(capsys, "config=simclr", *QUICK, "optim.max_steps=2", "checkpoint.auto_resume=false",
                           f"output_dir={out}")
    assert code == 0 and "moved to" in stdout
    (previous,) = (out / "previous").iterdir()
    assert (previous / "metrics.jsonl").read_text() == old_records
    assert sorted(p.name for p in (previous / "checkpoints").glob("checkpoint_*.pt")) == ["checkpoint_000000004.pt"]
    # the new run's records and checkpoints are its own
    assert max(r["step"] for r in metrics(out)) == 2
    assert latest_state(out)["position"]["step"] == 2
    assert not (out / "checkpoints" / "checkpoint_000000004.pt").exists()


# -------------------------------------------------------------------------------- exact resume, all 9
def _hooks(recipe: str, extra: dict) -> str:
    return "hooks=" + _render([extra])  # added to the recipe's own hooks (method.hooks), which stay


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_resumes_bit_identically(tmp_path: Path, recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    """8 steps over 2 epochs, a checkpoint every 3; a crash after step 5 loses steps 4-5, which the resumed run
    (from the mid-epoch checkpoint of step 3) redoes: the end state equals an uninterrupted run's, bit for bit."""
    args = [f"config={recipe}", *SMALL, *RECIPES[recipe], "optim.epochs=2", "checkpoint.every_n_steps=3",
            "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0", "eval.knn.enabled=false", "log.tensorboard=false",
            "imports=[sslkit_faults]"]
    ref = tmp_path / "ref"
    assert _run(capsys, *args, _hooks(recipe, {"name": "fault_crash", "step": 10**6}), f"output_dir={ref}")[0] == 0
    out = tmp_path / "crashed"
    crash = _hooks(recipe, {"name": "fault_crash", "step": 5})
    with pytest.raises(RuntimeError, match="injected crash after step 5"):
        main([*args, crash, f"output_dir={out}"])
    capsys.readouterr()
    assert latest_state(out)["position"]["step"] == 3
    code, stdout, _ = _run(capsys, *args, crash, f"output_dir={out}")
    assert code == 0 and "checkpoint_000000003.pt" in stdout
    expected, got = latest_state(ref), latest_state(out)
    assert expected["position"]["step"] == 8
    assert_identical(got, expected)


# ------------------------------------------------------------------- failures a user causes: a message
def test_batch_larger_than_the_folder_says_what_batch_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    images = tmp_path / "images" / "a"
    images.mkdir(parents=True)
    for i in range(20):
        Image.new("RGB", (16, 16), (i * 10, 0, 0)).save(images / f"{i}.png")
    code, _, err = _run(capsys, "config=simclr", "data=folder", f"data.train.path={images.parent}",
                        "machine.device=cpu",
                        "data.num_workers=0", "model.trunk=small_cnn", "data.image_size=16", "data.small_image_size=8",
                        "data.eval_transform.resize=16", "data.batch_size=32", "eval.knn.enabled=false",
                        f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in err
    assert "the training data has 20" in err and "Set data.batch_size=20 or lower" in err


@pytest.mark.parametrize("kind", ["file", "under_a_file", "unwritable"])
def test_unusable_output_dir_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    (tmp_path / "f").write_text("x")
    target = {"file": tmp_path / "f", "under_a_file": tmp_path / "f" / "run", "unwritable": Path("/proc/sslkit")}[kind]
    code, _, err = _run(capsys, "config=simclr", *QUICK, f"output_dir={target}")
    assert code == 2 and "Traceback" not in err
    assert {"file": "is a file, not a folder", "under_a_file": "a part of that path is a file",
            "unwritable": "cannot be written"}[kind] in err


def test_full_disk_at_a_checkpoint_keeps_the_last_one_and_leaves_no_temporary_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The step-4 checkpoint goes to /dev/full (its temporary file is a link there): ENOSPC, as on a full disk."""
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    tmp = ckpts / f"checkpoint_000000004.pt.tmp.{os.getpid()}"
    args = ["config=simclr", *QUICK, "checkpoint.every_n_steps=2", "imports=[sslkit_faults]", f"output_dir={out}"]
    code, _, err = _run(capsys, *args, "hooks=[{name: fault_full_disk, step: 4}]")
    assert code == 1 and "Traceback" not in err
    assert "No space left on device" in err and "checkpoint_000000002.pt, is intact" in err
    assert not os.path.lexists(tmp) and not list(ckpts.glob("*.tmp*"))
    assert (ckpts / "latest.txt").read_text() == "checkpoint_000000002.pt"
    # once there is room, the same command resumes from step 2
    code, stdout, _ = _run(capsys, *args, "hooks=[{name: fault_full_disk, step: 10000}]",
                           "checkpoint.resume_changed_config=true")
    assert code == 0 and "checkpoint_000000002.pt" in stdout and latest_state(out)["position"]["step"] == 4


def test_full_disk_for_the_metrics_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, _, err = _run(capsys, "config=simclr", *QUICK, "log.every_n_steps=1", "imports=[sslkit_faults]",
                        "hooks=[{name: fault_full_disk, step: 2, file: metrics}]", f"output_dir={out}")
    assert code == 1 and "Traceback" not in err
    assert f"cannot write to {out / 'metrics.jsonl'}: No space left on device" in err
    assert "resumes from the last complete one" in err


def test_no_readable_checkpoint_is_a_message_and_auto_resume_false_starts_afresh(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["config=simclr", *QUICK, "checkpoint.every_n_steps=2", f"output_dir={out}"]
    assert _run(capsys, *args)[0] == 0
    for ckpt in (out / "checkpoints").glob("checkpoint_*.pt"):
        ckpt.write_bytes(b"not a checkpoint")
    code, _, err = _run(capsys, *args)
    assert code == 2 and "Traceback" not in err
    assert "can be read" in err and "checkpoint.auto_resume=false" in err
    code, stdout, _ = _run(capsys, *args, "checkpoint.auto_resume=false")
    assert code == 0 and "moved to" in stdout
    assert latest_state(out)["position"]["step"] == 4


def test_debug_flag_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sslkit.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"optim\.lr"):
        main(["config=simclr", *QUICK, "optim.lr=-1", f"output_dir={tmp_path}", "--debug"])


def test_mistyped_fashion_mnist_path_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "config=simclr", "data=fashion_mnist", f"data.train.path={tmp_path / 'fashon'}",
                        f"output_dir={tmp_path / 'run'}", "machine.device=cpu")
    assert code == 2 and "'data.train.path'" in err and "does not exist" in err
    assert not (tmp_path / "run").exists()


def test_knn_k_above_the_memory_is_said_with_the_value_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    code, stdout, _ = _run(capsys, "config=simclr", *QUICK, "eval.knn.k=500", f"output_dir={tmp_path}")
    assert code == 0
    assert "eval.knn.k=500 but the memory (the train split) has 64 samples: using k=64" in stdout
    results = [line for line in stdout.splitlines() if "kNN at step" in line]
    assert results and all("(k=64," in line for line in results), results  # the k used, not the one asked for


def test_imports_takes_a_bare_module_name_from_the_working_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "my_bare_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hooks.py").write_text(
        "from sslkit.hooks.base import SSLHook\nfrom sslkit.registry import register_hook\n\n"
        "@register_hook('bare_marker')\nclass Marker(SSLHook):\n"
        "    def on_end(self, task):\n        print('bare marker at step', task.clock.step)\n")
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = _run(capsys, "config=simclr", *QUICK, "imports=my_bare_pkg.hooks", "hooks=[{name: bare_marker}]",
                           "eval.knn.enabled=false", f"output_dir={tmp_path / 'run'}")
    assert code == 0 and "bare marker at step 4" in stdout
