"""The suite itself: no test has a wall-clock deadline a slow or busy machine could reach (it waits for an event
under helpers.HANG_S instead), and `import sslkit.launch.cli` pulls in none of the heavy libraries."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from helpers import HANG_S, REPO

#: Literal timeouts the scan allows, with why: (file, line text) -> reason.
ALLOWED_TIMEOUTS = {
    ("tests/distributed/test_slurm.py", "sinfo"): "a probe at collection time: a SLURM that does not answer in a "
    "minute is treated as absent (its tests are skipped), it fails nothing",
}


def _deadlines(path: Path, root: Path = REPO) -> list[str]:
    """``timeout=<number>`` below HANG_S and ``time.time() / time.monotonic() + <number>`` in ``path``."""
    found: list[tuple[int, str]] = []
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    rel = str(path.relative_to(root))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "timeout" and isinstance(node.value, ast.Constant):
            line = lines[node.value.lineno - 1]
            allowed = any(f == rel and text in line for f, text in ALLOWED_TIMEOUTS)
            if isinstance(node.value.value, int | float) and node.value.value < HANG_S and not allowed:
                found.append((node.value.lineno, f"{rel}:{node.value.lineno}: timeout={node.value.value}"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.Constant):
            call = node.left
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("time", "monotonic", "perf_counter")):
                found.append((node.lineno, f"{rel}:{node.lineno}: a deadline of {node.right.value} s"))
    return [text for _, text in sorted(found)]


def test_no_test_has_a_deadline_a_busy_machine_could_reach() -> None:
    """Every wait is for an event (a file, a line, an exit) under helpers.HANG_S; a literal timeout or deadline
    shorter than that is a test of the machine's speed."""
    found = [d for p in sorted((REPO / "tests").rglob("*.py")) for d in _deadlines(p)]
    assert not found, "wall-clock deadlines in tests (wait for the event under helpers.HANG_S):\n" + "\n".join(found)


def test_the_scan_finds_a_deadline(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("import subprocess, time\nsubprocess.run(['x'], timeout=30)\nend = time.monotonic() + 5\n"
                   "subprocess.run(['x'], timeout=HANG_S)\n")
    assert [d.split(": ", 1)[1] for d in _deadlines(bad, tmp_path)] == ["timeout=30", "a deadline of 5 s"]


#: What ``import sslkit.launch.cli`` must not import: the CLI answers ``--help`` and a config error before any of them
#: would have loaded (torch alone takes seconds); a run imports each where it is used.
HEAVY = ("torch", "torchvision", "timm", "numpy", "matplotlib", "tensorboard", "onnx", "onnxruntime", "wandb",
         "mlflow", "PIL", "umap", "submitit")

#: What a small CNN run on the CPU (log.tensorboard=false, no report) must not import: they are for other runs.
NOT_FOR_A_CNN_RUN = ("timm", "matplotlib", "tensorboard", "torch.utils.tensorboard", "onnx", "onnxruntime", "wandb",
                     "mlflow", "umap", "submitit", "torch.distributed.checkpoint")


def _modules_after(code: str) -> set[str]:
    """The top-level and dotted module names in ``sys.modules`` after ``code`` ran in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint('MODULES', json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODULES "))
    return set(json.loads(line[len("MODULES "):]))


def test_importing_the_cli_loads_no_heavy_library() -> None:
    loaded = _modules_after("import sslkit.launch.cli")
    assert not {m.split(".")[0] for m in loaded} & set(HEAVY), sorted({m.split(".")[0] for m in loaded} & set(HEAVY))


def test_a_small_cnn_run_imports_only_what_it_uses(tmp_path: Path) -> None:
    """config=simclr with the small CNN (the device augmentation on the CPU uses torchvision's roi_align, so
    torchvision is in; torch's optimizers import torch._dynamo, and with it DTensor): no ViT library, no plotting,
    no TensorBoard when it is off, no trackers, no sharded checkpoints."""
    from helpers import SMALL

    args = ["config=simclr", *SMALL, "optim.max_steps=2", "eval.knn.enabled=false", "log.tensorboard=false",
            f"output_dir={tmp_path / 'run'}"]
    loaded = _modules_after(f"from sslkit.launch.cli import main\nassert main({args!r}) == 0")
    assert "torch" in loaded and "sslkit.builder" in loaded  # (it did train)
    assert not loaded & set(NOT_FOR_A_CNN_RUN), sorted(loaded & set(NOT_FOR_A_CNN_RUN))
