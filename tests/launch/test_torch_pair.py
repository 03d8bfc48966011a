"""A torchvision that does not load with this torch: every entry point says which pair and what to install, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import HANG_S, REPO

from sslkit.launch import cli
from sslkit.launch.runtime import matching_torchvision, pair_note, pair_problem, run_entry

#: What a torchvision built for another torch raises while it is imported (a user's torch 2.13 + torchvision).
BROKEN = 'raise RuntimeError("operator torchvision::nms does not exist")'


def _raise_inside_torchvision() -> int:
    """Raise as torchvision's own module code does while it is imported (a ``<module>`` frame in its folder)."""
    exec(compile(BROKEN, str(Path("site-packages", "torchvision", "__init__.py").absolute()), "exec"))
    return 0


def test_the_pair_rule() -> None:
    assert matching_torchvision("2.13.0+cpu") == "0.28" and matching_torchvision("2.0.1") == "0.15"
    assert matching_torchvision("1.13.1") is None
    assert pair_note("2.13.0+cpu", "0.29.1") == "torchvision 0.29.1 is the release for torch 2.14, not 2.13.0+cpu"
    assert pair_note("2.14.1", "0.29.1+cu130") == "" and pair_note("2.14.1", None) == ""


def test_the_failure_is_recognised_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_entry(_raise_inside_torchvision) == 2
    err = capsys.readouterr().err
    assert err.startswith("sslkit: error: torchvision ") and "operator torchvision::nms does not exist" in err
    assert f"does not load with torch {version('torch')}" in err and "pip install --force-reinstall torch" in err
    assert pair_problem(ValueError("a bug elsewhere")) is None
    def bug() -> int:
        raise ValueError("a bug elsewhere")

    with pytest.raises(ValueError, match="a bug elsewhere"):  # re-raised: a traceback for a bug
        run_entry(bug)


def test_tools_run_and_the_sslkit_command_say_it(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_main", lambda args: _raise_inside_torchvision())
    assert cli.main(["config=simclr"]) == 2
    assert "sslkit: error: torchvision " in capsys.readouterr().err
    monkeypatch.setattr(cli, "_command", lambda name: lambda args: _raise_inside_torchvision())
    assert cli.console(["list"]) == 2
    assert "does not load with torch" in capsys.readouterr().err


def _fake_torchvision(root: Path) -> dict[str, str]:
    """A torchvision 0.30.0 (another torch's release) first on the path, which fails as the mismatched one did."""
    (root / "torchvision").mkdir(parents=True)
    (root / "torchvision" / "__init__.py").write_text(BROKEN + "\n")
    meta = root / "torchvision-0.30.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.30.0\n")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}


@pytest.mark.slow
def test_a_mismatched_torchvision_stops_a_run_and_doctor_names_the_pair(tmp_path: Path) -> None:
    """The whole way, in new processes: tools/run.py stops before its run folder is made, with the versions and
    what to install; sslkit doctor's torchvision row fails with the same, and the rows that need it point there."""
    env = _fake_torchvision(tmp_path / "site")
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, str(REPO / "tools" / "run.py"), "config=simclr", "data=synthetic",
                          f"output_dir={out}"], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and not out.exists()
    assert f"torchvision 0.30.0 does not load with torch {version('torch')}" in run.stderr
    assert "0.30.0 is the release for torch 2." in run.stderr and "pip install 'torchvision==0." in run.stderr
    doctor = subprocess.run([sys.executable, "-m", "sslkit", "doctor", "--device", "cpu", "--recipes", "simclr",
                             "--no-collective", "--no-data", "--steps", "1"], capture_output=True, text=True,
                            env=env, timeout=HANG_S, cwd=REPO)
    assert doctor.returncode == 1, doctor.stderr
    assert f"torchvision    FAILED   0.30.0 with torch {version('torch')}: does not load" in doctor.stdout
    assert "recipe simclr  FAILED   torchvision does not load with this torch" in doctor.stdout
