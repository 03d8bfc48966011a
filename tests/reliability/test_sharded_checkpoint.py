"""Sharded checkpoint folders in one process: complete only with their .metadata, pruned like files, read without
running code, and loaded in full for evaluation (the multi-process cases are in tests/distributed/test_fsdp.py and
test_elastic.py)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL
from reliability_helpers import assert_identical, latest_state

from sslkit.checkpointing.sharded import _put, read_whole
from sslkit.launch.cli import main

ARGS = ["config=dino_vit", *SMALL, *RECIPES["dino_vit"], "optim.epochs=2", "checkpoint.every_n_steps=3",
        "checkpoint.every_n_epochs=0", "eval.knn.enabled=false", "log.tensorboard=false", "checkpoint.sharded=true"]


def _folders(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-process dino_vit run with sharded checkpoints at steps 3, 6 and 8, all kept."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    assert main([*ARGS, "checkpoint.keep_last=0", f"output_dir={out}"]) == 0
    return out


def test_a_folder_holds_one_file_per_process_and_the_metadata(run: Path) -> None:
    assert _folders(run) == ["checkpoint_000000003", "checkpoint_000000006", "checkpoint_000000008"]
    assert sorted(os.listdir(run / "checkpoints" / "checkpoint_000000008")) == [".metadata", "__0_0.distcp"]
    assert (run / "checkpoints" / "latest.txt").read_text() == "checkpoint_000000008"


def test_read_whole_gives_what_a_one_file_checkpoint_of_the_same_run_holds(run: Path, tmp_path: Path) -> None:
    """The same run with checkpoint.sharded=false writes a file; the folder read whole (optimizer included) holds
    the same model, optimizer state (by name), loss, hooks and position, bit for bit."""
    whole = tmp_path / "whole"
    assert main([*ARGS, "checkpoint.keep_last=0", "checkpoint.sharded=false", f"output_dir={whole}"]) == 0
    from_file = latest_state(whole)
    from_folder = read_whole(str(run / "checkpoints" / "checkpoint_000000008"), optimizer=True)
    assert_identical(_sorted(from_folder["model"]), _sorted(from_file["model"]))
    for key in ("loss", "hooks", "position", "rng"):
        assert_identical(from_folder[key], from_file[key], key)
    numbered = from_file["optimizer"]  # numbered parameters, in param-group order; the folder's are named
    by_name = dict(zip([n for g in from_folder["optimizer"]["param_groups"] for n in g["params"]],
                       [i for g in numbered["param_groups"] for i in g["params"]], strict=True))
    assert set(from_folder["optimizer"]["state"]) == {n for n, i in by_name.items() if i in numbered["state"]}
    for name, state in from_folder["optimizer"]["state"].items():
        assert_identical(state, numbered["state"][by_name[name]], f"optimizer.state.{name}")


def _sorted(state: dict) -> dict:
    return {k: state[k] for k in sorted(state)}


def test_a_folder_without_its_metadata_is_never_loaded(run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A save that never finished (no .metadata; latest.txt still names it, as when a run dies between the two):
    the run resumes from the newest complete folder, and the unfinished one is removed once a newer save
    completes."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    os.remove(out / "checkpoints" / "checkpoint_000000008" / ".metadata")
    assert main([*ARGS, "checkpoint.keep_last=0", "optim.epochs=3", "checkpoint.resume_changed_config=true",
                 f"output_dir={out}"]) == 0
    assert "resumed from " + str(out / "checkpoints" / "checkpoint_000000006") in capsys.readouterr().out
    assert _folders(out) == [f"checkpoint_{i:09d}" for i in (3, 6, 9, 12)]  # 8 gone, 9 and 12 complete


def test_keep_last_prunes_folders(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main([*ARGS, "checkpoint.keep_last=2", f"output_dir={out}"]) == 0
    assert _folders(out) == ["checkpoint_000000006", "checkpoint_000000008"]


def test_a_metadata_that_would_run_code_is_refused_not_fallen_back_from(run: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    shutil.copytree(run, out)

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    (out / "checkpoints" / "checkpoint_000000008" / ".metadata").write_bytes(pickle.dumps(Evil()))
    code = main([*ARGS, "checkpoint.keep_last=0", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "which loading would call" in err and "system" in err, err
    assert "Traceback" not in err and not (tmp_path / "owned").exists()


def test_put_builds_nested_dicts_and_lists() -> None:
    root: dict = {}
    _put(root, ("optimizer", "param_groups", 1, "lr"), 0.5)
    _put(root, ("optimizer", "param_groups", 0, "params"), ["a"])
    _put(root, ("optimizer", "state", "a", "step"), torch.tensor(3.0))
    assert root["optimizer"]["param_groups"] == [{"params": ["a"]}, {"lr": 0.5}]
    assert root["optimizer"]["state"]["a"]["step"].item() == 3.0


def test_evaluation_reads_a_folder_itself_or_the_run_and_refuses_an_unfinished_one(run: Path, tmp_path: Path) -> None:
    """checkpoint= a sharded folder loads its model strictly (as the run folder does: the same weights); a folder
    whose save never finished is refused with what to give instead."""
    from sslkit.checkpoint import CheckpointError
    from sslkit.tools.pretrained import load_pretrained

    folder = run / "checkpoints" / "checkpoint_000000006"
    got = load_pretrained(str(folder), ["machine.device=cpu"])
    assert got.step == 6 and got.run_dir == str(run)
    latest = load_pretrained(str(run), ["machine.device=cpu"])
    assert latest.step == 8 and latest.path == str(run / "checkpoints" / "checkpoint_000000008")
    unfinished = tmp_path / "checkpoint_000000009"
    shutil.copytree(folder, unfinished)
    os.remove(unfinished / ".metadata")
    with pytest.raises(CheckpointError, match=r"no \.metadata: its save never finished"):
        load_pretrained(str(unfinished))
