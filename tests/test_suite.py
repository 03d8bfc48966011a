"""The suite itself: no test has a wall-clock deadline a slow or busy machine could reach (it waits for an event
under helpers.HANG_S instead), and `import sslkit.launch.cli` pulls in none of the heavy libraries."""

from __future__ import annotations

import ast
import json
import os
import signal
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


#: A script that prints what a new interpreter gives it and exits with code 3 (tests/forkrun.py's promise).
PROBE = """
import json, multiprocessing.forkserver as fs, os, signal, sys, tempfile
disposition = lambda s: {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}.get(signal.getsignal(s), "handler")
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path, "own_group": os.getpgid(0) == os.getpid(),
    "env": {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "SSLKIT_MALLOC"))},
    "signals": {s.name: disposition(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGUSR1,
                                                    signal.SIGCHLD, signal.SIGHUP)},
    "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "stdin": sys.stdin.read(), "fork_server": fs._forkserver._forkserver_address,
    "start_method": __import__("multiprocessing").get_start_method(),
    "main": __name__, "file": __file__, "malloc": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
    "tempdir": tempfile.gettempdir(),
}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def _from_a_terminal(argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
    """``subprocess.Popen`` with SIGINT and SIGHUP at their defaults, as under a terminal's shell (a pytest-xdist
    worker ignores both, and an ignored signal stays ignored in what it starts)."""

    def defaults() -> None:
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)

    return subprocess.Popen(argv, preexec_fn=defaults, **kwargs)  # type: ignore[call-overload]


def test_a_forked_command_sees_what_a_new_interpreter_would(tmp_path: Path) -> None:
    """tests/forkrun.py forks the suite's ``python SCRIPT.py`` commands from a server with torch imported: the
    script sees the argv, working folder, environment (its TMPDIR for tempfile too), sys.path, signal dispositions,
    stdin, streams, session, start method and exit code of a new interpreter started from a terminal, and no fork
    server of the parent's; only the malloc thresholds of tools/run.py's re-execution are added."""
    import forkrun

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "extra"), "PROBE_VALUE": "1", "TMPDIR": str(tmp_path / "tmp")}
    argv = [sys.executable, "sub/probe.py", "a b", "--flag"]
    forkrun.ensure_server()
    seen = []
    for start in (_from_a_terminal, forkrun.popen):
        proc = start(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 3 and err == "to stderr\n", err
        seen.append(json.loads(out))
    new, forked = seen
    assert isinstance(proc, forkrun.ForkedProcess)  # (the second one was forked)
    assert new.pop("malloc") is None and forked.pop("malloc") == "4294967296"
    assert forked == new and forked["own_group"] and forked["fork_server"] is None
    assert forked["path"][:2] == [str(tmp_path / "sub"), str(tmp_path / "extra")]
    assert forked["tempdir"] == str(tmp_path / "tmp")  # its own TMPDIR, not the server's cached temporary folder


def test_a_forked_command_ends_as_an_interpreter_does_on_a_signal_or_an_uncaught_ctrl_c(tmp_path: Path) -> None:
    import forkrun

    (tmp_path / "wait.py").write_text("import sys, time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    codes = []
    for start in (_from_a_terminal, forkrun.popen):
        for sig in (signal.SIGINT, signal.SIGTERM):
            # stderr to a file: the KeyboardInterrupt traceback must not wait on an inherited pipe nobody reads
            proc = start([sys.executable, "wait.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=(tmp_path / f"err{len(codes)}.txt").open("w"), text=True, start_new_session=True)
            assert proc.stdout.readline() == "ready\n"
            os.killpg(proc.pid, sig)
            codes.append(proc.wait(timeout=HANG_S))
    assert codes[:2] == codes[2:] == [-signal.SIGINT, -signal.SIGTERM]
