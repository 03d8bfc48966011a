"""sslkit doctor: its table says what ran and what failed, its exit status follows, bad arguments get a message."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import forkrun
import pytest
from helpers import HANG_S, REPO, wait_for

from sslkit.launch import doctor
from sslkit.launch.cli import console


def test_recipes_and_determinism_pass_and_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    code = console(["doctor", "--device", "cpu", "--recipes", "simclr,ijepa", "--steps", "2", "--no-collective",
                    "--no-data"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"recipe simclr +ok +2 updates on cpu, last loss \d+\.\d+", out), out
    assert re.search(r"recipe ijepa +ok +2 updates on cpu", out), out
    assert re.search(r"deterministic +ok +dino_vit twice, 2 updates: all \d+ tensors identical", out), out
    assert re.search(r"^torch +info +\d", out, flags=re.M) and "all checks passed" in out
    assert out.count("recipe simclr") == 1 and out.count("deterministic") == 1, f"a row printed twice:\n{out}"


def test_paper_recipes_are_cuda_only_and_keep_their_real_size(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """On the CPU a paper-scale row says why it is skipped; its synthetic-data overrides change the source of the
    images and nothing the recipe trains (model, crops, masks, loss, optimizer) but DINOv2's one-GPU batch."""
    from omegaconf import OmegaConf

    from sslkit.config.compose import compose_config

    code = doctor.main(["--device", "cpu", "--recipes", "ibot_vitb16", "--no-collective", "--no-data", "--steps", "1"])
    out = capsys.readouterr().out
    assert re.search(r"paper ibot_vitb16 +skipped +CUDA only", out), out
    assert code == 0, out
    assert set(doctor.PAPER_RECIPES) == {f"{m}_{s}" for m in ("dinov2", "ibot", "ijepa") for s in ("vits16", "vitb16")
                                         } | {"dinov3_vits16"}
    (tmp_path / "a.jpg").touch()  # the folder check looks for an image file
    for recipe, extra in doctor.PAPER_RECIPES.items():
        real = compose_config([f"config={recipe}", "data=folder", f"data.train.path={tmp_path}", "machine.device=cpu",
                               *extra])
        check = compose_config([f"config={recipe}", *doctor.PAPER, *extra, "machine.device=cpu"])
        for key in ("model", "data.transform", "masking", "loss", "optim", "amp", "data.batch_size",
                    "data.image_size", "data.small_image_size"):
            assert OmegaConf.select(check, key) == OmegaConf.select(real, key), (recipe, key)
        assert check.data.train.source == "synthetic" and check.data.train.kwargs.image_size == 224


def test_a_failing_recipe_is_a_failed_row_and_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(doctor.SMALL_RECIPES, "simclr", ["optim.lr=-1"])  # refused by the config check
    code = doctor.main(["--device", "cpu", "--recipes", "simclr", "--steps", "1", "--no-collective", "--no-data"])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"recipe simclr +FAILED +ConfigError: .*optim\.lr", out), out
    assert re.search(r"^ +-> python tools/run.py config=simclr shows the whole error", out, flags=re.M), out
    assert out.rstrip().endswith("FAILED: recipe simclr")


def test_bad_arguments_say_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--recipes", "simclrr", "--no-collective", "--no-data"]) == 2
    assert "unknown recipe simclrr" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert doctor.main(["--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_the_collective_check_runs_two_processes_and_checks_the_values() -> None:
    row = doctor.collective_check()
    assert row.status == "ok", row
    assert re.match(r"2 processes over (gloo|nccl): all-reduce and broadcast right; 64 MiB all-reduce [\d.]+ ms",
                    row.detail), row.detail


#: ``sslkit doctor`` with the simclr check's run reading through two data workers (the small recipes read in the
#: main process), as the data and paper-scale checks do.
_WITH_WORKERS = ("import sys\nfrom sslkit.launch import doctor\n"
                 "doctor.SMALL_RECIPES['simclr'] = [*doctor.SMALL_RECIPES['simclr'], 'data.num_workers=2']\n"
                 "sys.exit(doctor.main(sys.argv[1:]))\n")


@pytest.mark.parametrize("group", [False, True], ids=["to the doctor", "to its process group, workers too"])
@pytest.mark.parametrize(("sig", "code", "by"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_ctrl_c_or_sigterm_stops_the_doctor_not_only_its_check(tmp_path: Path, sig: int, code: int, by: str,
                                                               group: bool) -> None:
    """A signal in the middle of a recipe's run (its metrics file written: training) ends the doctor with the table
    so far and a one-line reason, no traceback; a training run's pre-emption handling would have checkpointed that
    run and gone on to the next check (here: a determinism check of 10^6 updates, which would not end). Sent to the
    process group (a terminal's Ctrl-C, ``timeout``) it also ends the run's data workers, whose loader error the
    check used to report as its failure before going on (seen on a GPU under ``timeout 70 sslkit doctor``)."""
    # forked from the tests' server (torch imported): a new interpreter's imports cost about 5 s of a core here
    if group:
        script = tmp_path / "doctor_with_workers.py"
        script.write_text(_WITH_WORKERS)
        start = [sys.executable, str(script)]
    else:
        start = [str(Path(sys.executable).parent / "sslkit"), "doctor"]
    proc = forkrun.popen([*start, "--device", "cpu", "--recipes", "simclr", "--steps", "1000000",
                          "--no-collective", "--no-data"], cwd=REPO, text=True, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: any(tmp_path.glob("sslkit-doctor-*/simclr/metrics.jsonl")), "the recipe's run to train",
                 proc)
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, (out, err)
    assert f"sslkit doctor: stopped by {by} with" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("sslkit-doctor-*")), "the checks' folder is left behind"
