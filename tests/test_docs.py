"""The code in docs/ runs: the worked examples go through tools/run.py, and every shell command shown runs verbatim."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import forkrun
import pytest
import reliability_helpers  # noqa: F401  (puts the fault-injection hooks, sslkit_faults, on the import path)
from helpers import HANG_S, REPO, SMALL


def python_block(doc: str) -> str:
    """The one ```python block of ``docs/<doc>``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / doc).read_text(), flags=re.S)
    assert len(blocks) == 1, f"{doc} should hold exactly one python example"
    return blocks[0]


def _doc_module(factory: pytest.TempPathFactory, doc: str, module: str) -> Iterator[str]:
    """The python block of ``docs/<doc>`` as the module ``module`` (imported once per test module: it registers
    names), yielding the ``imports=`` override that loads it."""
    folder = factory.mktemp(module)
    (folder / f"{module}.py").write_text(python_block(doc))
    sys.path.insert(0, str(folder))
    yield f"imports=[{module}]"
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def doc_hooks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docs/hooks.md's example as the module ``doc_hooks`` (it registers ``embedding_std``)."""
    yield from _doc_module(tmp_path_factory, "hooks.md", "doc_hooks")


def test_hook_example_runs(tmp_path: Path, doc_hooks: str) -> None:
    from helpers import run_main

    proc = run_main("config=simclr", *SMALL, "optim.max_steps=4", "eval.knn.enabled=false", doc_hooks,
                    "hooks=[{name: embedding_std, every_n_steps: 2}]", f"output_dir={tmp_path / 'run'}")
    stds = [float(m) for m in re.findall(r"embedding std ([0-9.]+)", proc.stdout)]
    assert len(stds) == 2 and all(0 < s <= 1 for s in stds)


def test_hook_example_typo_is_named(tmp_path: Path, doc_hooks: str) -> None:
    from helpers import run_main

    proc = run_main("config=simclr", *SMALL, doc_hooks, "hooks=[{name: embedding_std, every_n_step: 2}]",
                    f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2
    expected = "'hooks[0].every_n_step' is not an argument of EmbeddingStdHook. Did you mean 'every_n_steps'?"
    assert expected in proc.stderr


@pytest.fixture(scope="module")
def doc_steps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docs/train_steps.md's example as the module ``doc_steps`` (it registers ``clipped``)."""
    yield from _doc_module(tmp_path_factory, "train_steps.md", "doc_steps")


def _clipped(capsys: pytest.CaptureFixture[str], doc_steps: str, out: Path, *args: str) -> str:
    from sslkit.launch.cli import main

    code = main([*SMALL, "eval.knn.enabled=false", "log.tensorboard=false", doc_steps, "train_step=clipped",
                 "checkpoint.keep_last=0", *args, f"output_dir={out}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out + captured.err


def _state(out: Path) -> dict:
    import torch

    ckpts = out / "checkpoints"
    return torch.load(ckpts / (ckpts / "latest.txt").read_text().strip(), weights_only=False)


def test_method_example_trains_with_its_schedule_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/methods.md's method in one file: registered, it trains, and its temperature falls with the clock."""
    from helpers import metrics

    from sslkit.launch.cli import main

    (tmp_path / "doc_method.py").write_text(python_block("methods.md"))
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["config=simclr", *SMALL, "eval.knn.enabled=false", "log.tensorboard=false", "log.every_n_steps=1",
                     "imports=[doc_method]", "method.name=annealed_simclr", "loss={}", "optim.max_steps=4",
                     f"output_dir={tmp_path / 'run'}"])
    finally:
        sys.path.remove(str(tmp_path))
    assert code == 0, capsys.readouterr().err
    temps = [r["temperature"] for r in metrics(tmp_path / "run") if "temperature" in r]
    assert temps == pytest.approx([0.5 - 0.4 * u / 4 for u in range(4)])


@pytest.mark.parametrize("recipe", ["simclr", "moco", "mocov3", "byol", "simsiam", "swav", "dino", "barlow_twins",
                                    "vicreg"])
def test_train_step_example_runs_every_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str], doc_steps: str,
                                              recipe: str) -> None:
    """The custom step of the docs, with each recipe (6 of them return a dict from their loss): it trains, logs,
    times its stages and keeps the method's hooks and schedules."""
    from helpers import RECIPES, metrics

    out = tmp_path / "run"
    stdout = _clipped(capsys, doc_steps, out, f"config={recipe}", *RECIPES[recipe], "optim.max_steps=2",
                      "log.every_n_steps=1")
    assert "step 2/2" in stdout
    assert "clip" in stdout and "optimizer_step" in stdout  # the timers: its own and the stages'
    records = [r for r in metrics(out) if r.get("phase") == "train" and "lr" in r]
    assert [r["step"] for r in records] == [1, 2] and all("weight_decay" in r for r in records)
    if recipe in ("byol", "dino", "moco", "mocov3"):
        assert all("teacher_momentum" in r for r in records)


def test_train_step_example_keeps_accumulation(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               doc_steps: str) -> None:
    """micro_batches=2 with batch 8: 4 updates of 16 images per epoch, both epochs run (the old example took
    one batch per update, so epoch 1 never ran)."""
    out = tmp_path / "run"
    stdout = _clipped(capsys, doc_steps, out, "config=simclr", "data.batch_size=8", "optim.micro_batches=2",
                      "optim.epochs=2")
    state = _state(out)["position"]
    assert (state["step"], state["samples"], state["phase_idx"]) == (8, 8 * 16, 2)
    assert "epoch 2/2 done" in stdout


@pytest.mark.parametrize("precision", [[], ["amp.enabled=true", "amp.dtype=float16"]], ids=["fp32", "fp16-scaler"])
def test_train_step_example_drops_a_non_finite_update(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      doc_steps: str, precision: list[str]) -> None:
    """nonfinite_loss=skip: the NaN step's update is dropped before the optimizer sees it (the old example logged
    "dropping the update" and applied it, leaving NaN in the weights). With float16 the example unscales the
    gradients through the GradScaler before clipping, and the dropped update still closes the scaler's step."""
    import torch

    out = tmp_path / "run"
    stdout = _clipped(capsys, doc_steps, out, "config=simclr", "optim.max_steps=4", "reliability.nonfinite_loss=skip",
                      "imports=[doc_steps, sslkit_faults]", "hooks=[{name: fault_nan, step: 2}]", *precision)
    assert "update dropped (non-finite loss)" in stdout
    state = _state(out)
    assert state["position"]["step"] == 4 and state["position"]["skipped_steps"] == {"non-finite loss": 1}
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    if precision:
        assert state["scaler"] is not None and state["scaler"]["scale"] < 65536.0  # it backed off at the NaN


# ------------------------------------------------------------------------- the commands the docs show
#: The markdown files whose commands must run.
DOC_FILES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
#: A 4-space-indented line starting with one of these is a shell command.
PROGRAMS = ("python", "torchrun", "sslkit", "pip", "apt-get")
#: Documentation patterns: a placeholder that stands for one real value, and the value the test runs.
EXPANSIONS = {"config=NAME": "config=simclr"}
#: Commands the test does not run, with the reason (a regular expression on the command).
SKIPPED = {
    r"--index-url https://download\.pytorch\.org/": "installs the CPU-only torch from download.pytorch.org, which "
    "CI cannot reach (it installs the default torch from PyPI), so it is not in .ci/run either",
    r"^torchrun --standalone .*data\.train\.path=/data/": "starts 8 interpreters (about 40 CPU-seconds here, too "
    "much for the suite's budget) to show a known limitation: each rank refuses the missing /data/train with exit "
    "2 (rank 0 prints the message, the others exit quietly), and then torchrun exits 1 with its own "
    "ChildFailedError report, which sslkit cannot shorten",
    r"eval\.knn\.baselines=true": "the random-init and pixel kNN baselines over all 70,000 Fashion-MNIST images "
    "take about a minute here before the first step, too long for the suite's budget; a Ctrl-C during them is acted "
    "on after them and the first step (exit 75 with a checkpoint), as docs/reliability.md says",
    r"^torchrun .*--nnodes=N\b": "the pattern for node i of N: torchrun itself rejects --nnodes=N / --node_rank=i "
    "(its own usage error) before sslkit starts, so there is no sslkit outcome to check",
    r"(s3://bucket/|https://host/)": "names a bucket or a host of the user's in object storage, which CI cannot reach "
    "(without an endpoint s3fs would look for AWS's own); tests/data/test_remote.py runs the same commands against "
    "moto's S3 server and an HTTP server on localhost",
}
#: Commands that misbehave today (a regular expression on the command -> what is wrong): strict xfail,
#: so the test fails once they are fixed and the mark must go.
KNOWN_BAD: dict[str, str] = {}
#: Commands that need what CI has not (a regular expression on the command -> what the refusal must name).
NEEDS_WHAT_CI_LACKS = {
    r"machine\.device=cuda": "machine.device",  # a GPU
    r"=(/data/\S+)": r"\1",  # a folder of the user's
    r"data=(cifar10|cifar100)\b": r"\1",  # a download (no network)
    r"\b(my_pkg)\.": r"\1",  # a placeholder package
    r"=(HOST0)\b": r"\1",  # a placeholder host
}
#: The line LogHook logs when training starts: "training N phases, N optimizer steps, ...; output in DIR".
TRAINING_LINE = re.compile(r"training \d+ phases, \d+ optimizer steps, .*; output in (\S+)")
#: The tests wait for events: the training line (once it is out, a Ctrl-C is acted on: LogHook logs it after every
#: hook's on_start), the header, the exit; a command still running after helpers.HANG_S is hung (killed, failed).
#: The exit status of a run stopped by a signal after its checkpoint (sslkit.reliability.PREEMPTED_EXIT_CODE).
PREEMPTED = 75
#: Written into my_ssl/ of the run folder for commands with imports=[my_ssl.<module>]: the docs' own example.
MY_SSL = {"my_ssl.hooks": ("hooks.py", "hooks.md"), "my_ssl.steps": ("steps.py", "train_steps.md"),
          "my_ssl.annealed": ("annealed.py", "methods.md")}


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after two or more spaces)."""
    return re.sub(r"\s{2,}#.*$", "", line).rstrip()


def commands_in(text: str) -> Iterator[tuple[int, str]]:
    """(line number, command) of every shell command of a markdown text: a 4-space-indented line (outside
    fenced blocks) starting with one of :data:`PROGRAMS`, trailing comment stripped, backslash continuations
    joined."""
    lines = text.splitlines()
    fenced, i = False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = re.match(r"    (\S.*)$", line)
        if not fenced and m and m.group(1).split()[0] in PROGRAMS:
            start, parts, current = i, [], _strip_comment(m.group(1))
            while current.endswith("\\") and i + 1 < len(lines):
                parts.append(current[:-1].strip())
                i += 1
                current = _strip_comment(lines[i].strip())
            parts.append(current.strip())
            yield start + 1, " ".join(p for p in parts if p)
        i += 1


def doc_commands() -> dict[str, list[str]]:
    """Every distinct command of :data:`DOC_FILES`, placeholders of :data:`EXPANSIONS` expanded ->
    where it is shown (``file:line``), in the order of first appearance. Commands that differ only in
    spacing are one."""
    found: dict[tuple[str, ...], tuple[str, list[str]]] = {}
    for doc in DOC_FILES:
        for lineno, command in commands_in((REPO / doc).read_text(encoding="utf-8")):
            for pattern, value in EXPANSIONS.items():
                command = re.sub(rf"(?<!\S){re.escape(pattern)}(?!\S)", value, command)
            key = tuple(shlex.split(command))
            found.setdefault(key, (command, []))[1].append(f"{doc}:{lineno}")
    return dict(found.values())


@dataclass(frozen=True)
class Plan:
    """How the test runs one command, and what it expects."""

    #: ``ci``: not run, must be in .ci/run; ``refusal``: exit 2 with a message naming ``names``; ``quick``:
    #: exit 0; ``train``: SIGINT once training started, exit 75 with a checkpoint; ``start``: gets through
    #: its start, then killed; ``tool``: an evaluation tool (``names``) on a tiny trained run put where the
    #: command's checkpoint= points, exit 0 with the files it promises; ``skip``: not run (``reason``).
    kind: str
    names: str = ""
    reason: str = ""


def plan(command: str) -> Plan:
    """Decide how :func:`test_doc_command` runs ``command`` (see :class:`Plan`)."""
    argv = shlex.split(command)
    for pattern, reason in SKIPPED.items():
        if re.search(pattern, command):
            return Plan("skip", reason=reason)
    if argv[0] in ("pip", "apt-get") or argv[:3] == ["python", "-m", "pytest"]:
        return Plan("ci")
    for pattern, names in NEEDS_WHAT_CI_LACKS.items():
        if m := re.search(pattern, command):
            # torchrun starts its processes (8 on 2 cores) before any of them can refuse
            return Plan("refusal", names=m.expand(names))
    if argv[:2] in (["sslkit", "list"], ["sslkit", "doctor"]) or "--help" in argv or \
            argv[:2] == ["python", "tools/audit.py"] or argv[:3] == ["sslkit", "data", "wild"]:
        return Plan("quick")
    if _tool(argv) is not None:
        fits = {"twin=none", "format=onnx", "format=hf", "student=vit_tiny"}  # what no torchvision twin is needed for
        if _tool(argv) == "export" and not fits & set(argv) and not re.search(_READS[DOC_RELEASED], command):
            # the tiny run's small CNN has no torchvision twin (docs/adapt.md's released ViT and ViT student: timm's)
            return Plan("refusal", names="no torchvision twin")
        return Plan("tool", names=_tool(argv) or "")
    if argv[:2] in (["python", "benchmarks/overhead.py"], ["python", "benchmarks/throughput.py"]):
        # Both loops run in one process with no signal handling of their own (Ctrl-C is a KeyboardInterrupt
        # traceback), for minutes: check that it gets through its start (config, build_task, the refusals,
        # the header line "machine: ...") and kill it there.
        return Plan("start")
    if argv[0] == "torchrun" and "--rdzv-endpoint=localhost:29400" in argv:
        # several "nodes" on this machine, each its own torchrun joining one c10d rendezvous: started as many
        # times as --nnodes says, side by side; a finite run that every copy ends with exit 0
        return Plan("nodes")
    if argv[:2] in (["python", "tools/run.py"], ["sslkit", "train"]) or argv[0] == "torchrun":
        return Plan("train")
    raise AssertionError(f"no rule in tests/test_docs.py says how to run the doc command {command!r}")


#: The tools run on a trained run: ``sslkit <sub>`` or ``python tools/<script>`` -> the subcommand.
TOOLS = {"eval_knn.py": "knn", "eval_linear.py": "linear", "extract_features.py": "extract", "export.py": "export",
         "eval_finetune.py": "finetune", "visualize.py": "viz"}


def _tool(argv: list[str]) -> str | None:
    """The evaluation tool ``argv`` runs (knn, linear, extract, export, report), or None."""
    if argv[0] == "sslkit" and len(argv) > 1 and argv[1] in (*TOOLS.values(), "report", "bench"):
        return argv[1]
    if argv[0] == "python" and len(argv) > 1 and argv[1].startswith("tools/"):
        return TOOLS.get(argv[1][len("tools/"):])
    return None


#: The run folder the docs' tool commands name; the test puts a tiny trained run there.
DOC_RUN = "runs/simclr-fashion_mnist"
_TINY_RUN: list[Path] = []


#: The distillation teacher the docs' distill commands name, and the distillation run their export reads: the test
#: puts a tiny run of each there (a one-channel CNN teacher for Fashion-MNIST; a small distillation).
DOC_TEACHER = "runs/dinov3-fashion_mnist"
DOC_DISTILL = "runs/distill-fashion_mnist"
_TINY_OTHERS: dict[str, Path] = {}


#: docs/adapt.md's path: the stand-in released model (a run holding its exported teacher.safetensors), the adapted
#: run and the distilled student; the test puts a tiny run of each there (the recipes' own networks on 64
#: Fashion-MNIST images, 2 updates), where a command reads them (the patterns: not where a command writes them).
DOC_RELEASED, DOC_ADAPTED, DOC_STUDENT = "runs/released", "runs/adapted", "runs/student"
_READS = {DOC_RELEASED: r"(model\.pretrained=runs/released/|checkpoint=runs/released(\s|$)|"
                        r"backbones=\[[^\]]*runs/released)",
          DOC_ADAPTED: r"(distill\.teacher=runs/adapted(\s|$)|checkpoint=runs/adapted(\s|$)|"
                       r"backbones=\[[^\]]*runs/adapted)",
          DOC_STUDENT: r"checkpoint=runs/student(\s|$)"}
#: Those tiny runs: 64 Fashion-MNIST images, 2 updates.
_FEW = ["data.limit=64", "data.batch_size=16", "data.num_workers=0", "optim.max_steps=2", "eval.knn.k=5",
        "eval.knn.batch_size=32", "log.tensorboard=false", "log.report=false"]


def _tiny_other(factory: pytest.TempPathFactory, which: str) -> Path:
    """A tiny finished run for :data:`DOC_TEACHER` (SimCLR's small CNN on one-channel images: a teacher for
    Fashion-MNIST), :data:`DOC_DISTILL` (the small distillation) or docs/adapt.md's (:data:`DOC_RELEASED` with its
    ``teacher.safetensors``, :data:`DOC_ADAPTED` from that file, :data:`DOC_STUDENT` of that), trained once."""
    if which not in _TINY_OTHERS:
        from helpers import RECIPES, run_main

        out = factory.mktemp("doc_tiny_other") / "run"
        made: dict[str, Callable[[], list[str]]] = {
            DOC_TEACHER: lambda: ["config=simclr", *SMALL, "data.train.kwargs.channels=1",
                                  "data.test.kwargs.channels=1"],
            DOC_DISTILL: lambda: ["config=distill", *SMALL, *RECIPES["distill"]],
            DOC_RELEASED: lambda: ["config=dinov3", *_FEW, "gram.start_step=1", "gram.every=1"],
            DOC_ADAPTED: lambda: ["config=dinov3_adapt_small", *_FEW, "model.pretrained="
                                  f"{_tiny_other(factory, DOC_RELEASED) / 'teacher.safetensors'}"],
            DOC_STUDENT: lambda: ["config=distill", *_FEW, f"distill.teacher={_tiny_other(factory, DOC_ADAPTED)}",
                                  "distill.students=[small_cnn, vit_tiny]"]}
        run_main(*made[which](), "optim.max_steps=2", "log.tensorboard=false", f"output_dir={out}")
        if which == DOC_RELEASED:
            from sslkit.tools.export import export_main

            assert export_main([f"checkpoint={out}", "features=teacher", f"output={out / 'teacher.safetensors'}"]) == 0
        _TINY_OTHERS[which] = out
    return _TINY_OTHERS[which]


def _others(factory: pytest.TempPathFactory, command: str, tool: bool) -> dict[str, Path]:
    """The tiny runs ``command`` names: the teacher of a distillation; the distillation run of a tool; what
    docs/adapt.md's commands read."""
    keys = {DOC_TEACHER: "distill.teacher", **({DOC_DISTILL: "checkpoint"} if tool else {})}
    found = {name: _tiny_other(factory, name) for name, key in keys.items()
             if re.search(rf"(?<!\S){re.escape(key)}={re.escape(name)}(\s|/|$)", command)}
    found.update({name: _tiny_other(factory, name) for name, pattern in _READS.items() if re.search(pattern, command)})
    return found


def _tiny_run(factory: pytest.TempPathFactory) -> Path:
    """A tiny finished SimCLR run (small CNN, synthetic data, 2 steps), trained once for the tool commands."""
    if not _TINY_RUN:
        from helpers import run_main

        out = factory.mktemp("doc_tiny_run") / "run"
        run_main("config=simclr", *SMALL, "optim.max_steps=2", "log.tensorboard=false", f"output_dir={out}")
        _TINY_RUN.append(out)
    return _TINY_RUN[0]


def _processes(command: str) -> int:
    """The number of processes ``command`` trains with (``distributed.nproc_per_node``, torchrun's
    ``--nproc_per_node``)."""
    m = re.search(r"nproc_per_node=(\d+)", command)
    nodes = re.search(r"--nnodes=(\d+)\b", command)
    return (int(m.group(1)) if m else 1) * (int(nodes.group(1)) if nodes else 1)


def _ci_steps() -> set[str]:
    """The commands of .ci/run, one per ``&&``-separated part, normalised by :func:`_normalise`."""
    steps = set()
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            steps.update(_normalise(part) for part in line.split("&&") if part.strip())
    return steps


def _normalise(command: str) -> str:
    """A command without what only changes how much it prints: quiet flags, ``python -m`` before pip, and
    output redirections and trailing comments; whitespace collapsed."""
    quiet = ("-q", "-qq", "--quiet")
    words = [w for w in shlex.split(command, comments=True) if w not in quiet and not re.match(r"\d?>", w)]
    if words[:3] == ["python", "-m", "pip"]:
        words = words[2:]
    return " ".join(words)


def _run_env(cwd: Path) -> dict[str, str]:
    """The environment of a doc command run in ``cwd``: this one without PYTHONPATH (``imports=`` must find
    modules of the working directory by itself), and TMPDIR and sslkit's cache (SSLKIT_CACHE_DIR: sslkit bench's
    features) in ``cwd`` (what a command leaves in them, such as benchmarks/overhead.py's run folder, goes with the
    test's)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TMPDIR": str(cwd),
            "SSLKIT_CACHE_DIR": str(cwd / ".cache")}


def _argv(command: str) -> list[str]:
    """``command`` as an argv, its program resolved next to this interpreter (``python`` is this interpreter;
    ``sslkit`` and ``torchrun`` are console scripts installed with it)."""
    argv = shlex.split(command)
    assert not set(argv) & {"&&", "||", "|", ";", ">", "<"}, f"a shell is needed for {command!r}"
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    script = Path(sys.executable).parent / argv[0]
    found = str(script) if script.exists() else shutil.which(argv[0])
    assert found, f"{argv[0]} is not installed (pip install -e .)"
    return [found, *argv[1:]]


def _workdir(tmp_path: Path, command: str, run: Path | None = None, others: dict[str, Path] | None = None) -> Path:
    """A folder to run ``command`` in: links to the repo's tools/, benchmarks/ and configs/ (so runs/ lands
    here), the tiny runs it names (``others``: folder -> run), and my_ssl/ with the docs' example when the command
    imports it."""
    for name in ("tools", "benchmarks", "configs"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    if run is not None and DOC_RUN in command:
        shutil.copytree(run, tmp_path / DOC_RUN)
    for folder, other in (others or {}).items():
        shutil.copytree(other, tmp_path / folder)
    for module, (file, doc) in MY_SSL.items():
        if f"imports=[{module}]" in command:
            (tmp_path / "my_ssl").mkdir(exist_ok=True)
            (tmp_path / "my_ssl" / "__init__.py").write_text("")
            (tmp_path / "my_ssl" / file).write_text(python_block(doc))
    return tmp_path


@dataclass
class Outcome:
    """What a command did: exit status, output, the run folder its training line named, and whether that
    folder held a checkpoint (``checkpoints/latest.txt``) when the command had ended."""

    returncode: int
    stdout: str
    stderr: str
    run_dir: str | None = None
    checkpoint: bool = False
    #: The folder the command ran in.
    cwd: Path = Path(".")


#: Process groups of the commands still running: killed at the end of the module, whatever happened.
_RUNNING: set[int] = set()


def _kill(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to a command's whole process group (loader workers, spawned ranks, torchrun's children)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _run(command: str, cwd: Path, p: Plan) -> Outcome:
    """Run ``command`` verbatim in ``cwd`` (its own session and process group, as a terminal starts it) and
    return what it did. ``train``: SIGINT to the group once the training line is out; ``start``: SIGKILL once
    its header is out. A command still running after :data:`HANG_S` is killed and fails the test."""
    out_file, err_file = cwd / "stdout.txt", cwd / "stderr.txt"
    with out_file.open("wb") as out, err_file.open("wb") as err:
        proc = forkrun.popen(_argv(command), cwd=cwd, env=_run_env(cwd), stdin=subprocess.DEVNULL, stdout=out,
                             stderr=err, start_new_session=True)
    _RUNNING.add(proc.pid)
    deadline = time.monotonic() + HANG_S
    run_dir = None
    try:
        while p.kind in ("train", "start") and proc.poll() is None and time.monotonic() < deadline:
            text = out_file.read_text(errors="replace")
            if p.kind == "start" and re.search(r"^machine: ", text, flags=re.M):
                _kill(proc.pid)
                break
            if m := TRAINING_LINE.search(text):
                run_dir = m.group(1)
                _kill(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
                break
            time.sleep(0.1)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(proc.pid)
        proc.wait()
        text = f"{out_file.read_text(errors='replace')[-2000:]}\n{err_file.read_text(errors='replace')[-2000:]}"
        pytest.fail(f"{command!r} still ran after {HANG_S:.0f} s (hung; killed); its output ends with:\n{text}")
    finally:
        _kill(proc.pid)  # nothing of it outlives its test
        _RUNNING.discard(proc.pid)
    checkpoint = run_dir is not None and (cwd / run_dir / "checkpoints" / "latest.txt").exists()
    return Outcome(proc.returncode, out_file.read_text(errors="replace"), err_file.read_text(errors="replace"),
                   run_dir, checkpoint, cwd)


#: Output folders under /tmp that doc commands name (output_dir=/tmp/...): removed before and after the run, so
#: that the command starts fresh each time (only under /tmp: the test removes nothing else outside its folder).
ABSOLUTE_OUTPUTS = re.compile(r"(?<!\S)output_dir=(/tmp/[^\s/]\S*)")


def _run_nodes(command: str, cwd: Path, p: Plan) -> Outcome:
    """``command`` started once per node (``--nnodes``) in ``cwd`` at the same time, as on several machines;
    each must end by itself (under :data:`HANG_S`). Returns the first failing copy's outcome, else node 0's
    with every copy's output."""
    nodes = int(re.search(r"--nnodes=(\d+)", command).group(1))  # type: ignore[union-attr]
    procs = []
    for i in range(nodes):
        out, err = (cwd / f"stdout.{i}.txt").open("wb"), (cwd / f"stderr.{i}.txt").open("wb")
        procs.append(forkrun.popen(_argv(command), cwd=cwd, env=_run_env(cwd), stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=err, start_new_session=True))
        _RUNNING.add(procs[-1].pid)
    deadline = time.monotonic() + HANG_S
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in procs:
                _kill(other.pid)
            codes.append(-1)
    texts = [((cwd / f"stdout.{i}.txt").read_text(errors="replace"),
              (cwd / f"stderr.{i}.txt").read_text(errors="replace")) for i in range(nodes)]
    bad = next((i for i, c in enumerate(codes) if c != 0), None)
    i = 0 if bad is None else bad
    m = TRAINING_LINE.search("".join(t[0] for t in texts))
    return Outcome(codes[i], "\n".join(t[0] for t in texts), "\n".join(t[1] for t in texts),
                   m.group(1) if m else None, False, cwd)


def _execute(command: str, cwd: Path, p: Plan) -> Outcome:
    """:func:`_run` (or :func:`_run_nodes`), with the command's absolute output folders removed before and after
    it."""
    absolute = [Path(m) for m in ABSOLUTE_OUTPUTS.findall(command)]
    for folder in absolute:
        shutil.rmtree(folder, ignore_errors=True)
    try:
        return _run_nodes(command, cwd, p) if p.kind == "nodes" else _run(command, cwd, p)
    finally:
        for folder in absolute:
            shutil.rmtree(folder, ignore_errors=True)


def _skip_reason(p: Plan) -> str | None:
    """Why a command with plan ``p`` is not run here, or None."""
    if p.kind == "skip":
        return p.reason
    if p.kind == "refusal" and p.names == "machine.device":
        import torch

        if torch.cuda.is_available():
            return "a CUDA device is here: the command is a GPU run, not the refusal this test checks"
    return None


def _runs(command: str) -> bool:
    """True for the commands :func:`test_doc_command` runs (not CI's, not skipped)."""
    p = plan(command)
    return p.kind != "ci" and _skip_reason(p) is None


#: Commands run at a time (the machine has 2 cores; much of a command is its ~4 s of imports, and the SIGINT
#: and hang checks wait): the first test starts every selected command, longest first, and each test waits
#: for its own.
CONCURRENT = 2
_POOL = ThreadPoolExecutor(max_workers=CONCURRENT, thread_name_prefix="doc-command")
_STARTED: dict[str, Future[Outcome]] = {}


def _expected_seconds(command: str) -> float:
    """A rough run time, to start the longest commands first (they would otherwise end the module alone)."""
    if "eval.knn.baselines=true" in command:
        return 20.0
    if _tool(shlex.split(command)) == "bench":  # every protocol on several backbones: 13-50 s alone here
        return 30.0
    return 5.0 + 3.0 * _processes(command)


def _start_all(request: pytest.FixtureRequest, factory: pytest.TempPathFactory) -> None:
    """Start the commands of every selected :func:`test_doc_command` (once), longest first."""
    if _STARTED:
        return
    forkrun.ensure_server()  # (here, before the pool's threads read this process's environment, which it swaps)
    selected = [item.callspec.params["command"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_doc_command" and hasattr(item, "callspec")
                and "multiprocess" not in item.keywords]  # (those run one at a time, in the multiprocess group)
    for command in sorted((c for c in selected if _runs(c)), key=_expected_seconds, reverse=True):
        tool = _tool(shlex.split(command)) is not None
        cwd = _workdir(factory.mktemp("doc_command"), command, _tiny_run(factory) if tool else None,
                       _others(factory, command, tool))
        _STARTED[command] = _POOL.submit(_execute, command, cwd, plan(command))


@pytest.fixture(scope="module", autouse=True)
def _stop_commands() -> Iterator[None]:
    """After the module: no command is left running (an interrupted session included)."""
    yield
    _POOL.shutdown(wait=False, cancel_futures=True)
    for pgid in list(_RUNNING):
        _kill(pgid)


def _params() -> list[pytest.param]:
    params = []
    for command, shown in COMMANDS.items():
        # one xdist worker runs them all (--dist loadgroup): the first doc test starts every selected command, so
        # tests of this module on two workers would run each command twice
        marks = [pytest.mark.slow, pytest.mark.xdist_group("doc_commands")]
        if _runs(command) and _processes(command) > 1:  # a process group: in the README's one-at-a-time part
            marks.append(pytest.mark.multiprocess)
        for pattern, why in KNOWN_BAD.items():
            if re.search(pattern, command):
                marks.append(pytest.mark.xfail(strict=True, reason=why))
        params.append(pytest.param(command, shown, marks=marks, id=command[:80]))
    return params


COMMANDS = doc_commands()


def test_doc_command_collector() -> None:
    """Indented commands are found, comments after two spaces stripped, continuations joined, fences skipped."""
    text = ("Run:\n\n    python tools/run.py config=simclr   # a comment\n    pip install x#y\n"
            "    torchrun --nnodes=2 \\\n        tools/run.py config=dino  # node 0\n    srun torchrun \\\n"
            "        tools/run.py\n\n```python\n    python inside_a_fence.py\n```\n      python not_four.py\n")
    assert list(commands_in(text)) == [(3, "python tools/run.py config=simclr"), (4, "pip install x#y"),
                                       (5, "torchrun --nnodes=2 tools/run.py config=dino")]
    assert "python tools/run.py config=simclr" in COMMANDS
    assert "python -m pytest -q" in COMMANDS


@pytest.mark.parametrize(("command", "shown"), _params())
def test_doc_command(command: str, shown: list[str], request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each command the docs show (at ``shown``) does what the docs promise, run verbatim: see :func:`plan`."""
    p = plan(command)
    if reason := _skip_reason(p):
        pytest.skip(reason)
    if p.kind == "ci":
        steps = _ci_steps()
        assert all(_normalise(part) in steps for part in command.split("&&")), (
            f"{command!r} (shown at {', '.join(shown)}) is not what .ci/run runs: {sorted(steps)}")
        return
    _start_all(request, tmp_path_factory)
    if command in _STARTED:
        got = _STARTED[command].result()
    else:  # a command of several processes: run here, in the group that runs process groups one at a time
        tool = _tool(shlex.split(command)) is not None
        cwd = _workdir(tmp_path_factory.mktemp("doc_command"), command, _tiny_run(tmp_path_factory) if tool else None,
                       _others(tmp_path_factory, command, tool))
        got = _execute(command, cwd, p)
    _check(command, shown, p, got)
    if got.cwd.resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve()):  # passed: not read again
        shutil.rmtree(got.cwd, ignore_errors=True)  # (the suite's /tmp: 2.5 GB of command folders otherwise)


def _check(command: str, shown: list[str], p: Plan, got: Outcome) -> None:
    """Assert what ``p`` expects of ``command``'s outcome ``got``."""
    both = got.stdout + got.stderr
    context = f"{command!r} (shown at {', '.join(shown)}): exit {got.returncode}\n{both[-3000:]}"
    assert "Traceback" not in both, context
    if p.kind == "quick":
        assert got.returncode == 0 and got.stdout.strip(), context
    elif p.kind == "start":
        assert got.returncode == -signal.SIGKILL, context  # killed after its header, not failed before
    elif p.kind == "refusal":
        message = got.stderr.strip()
        assert got.returncode == 2, context
        assert re.match(r"sslkit( \w+)?:", message) and "\n\n" not in message and p.names in message, context
    elif p.kind == "nodes":  # every node's torchrun ended by itself, one run over all their processes
        assert got.returncode == 0 and got.run_dir is not None, context
        batch = re.search(r"data\.batch_size=(\d+)", command)
        world = _processes(command) * (int(batch.group(1)) if batch else 256)
        assert re.search(rf"training .*global batch {world},", got.stdout), context
        assert (got.cwd / got.run_dir / "checkpoints" / "latest.txt").exists(), context
    elif p.kind == "tool":  # ran on the tiny run and wrote what the docs say
        assert got.returncode == 0, context
        written = {"knn": "eval/knn.json", "linear": "eval/linear.json", "report": "report.md",
                   "finetune": "eval/finetune.json", "viz": "viz/index.html"}
        if p.names == "export" and "format=onnx" in command and "output=" not in command:
            assert (got.cwd / DOC_RUN / "export" / "encoder.onnx").exists(), context
        if p.names in written:
            assert (got.cwd / DOC_RUN / written[p.names]).exists(), context
        for path in re.findall(r"(?<!\S)output=(\S+)", command):
            assert (got.cwd / path).exists(), context
    else:  # train
        assert got.run_dir is not None, f"training never started: {context}"
        assert got.returncode == PREEMPTED, context
        said = re.findall(r"sslkit: (?:stopped by SIGINT after step \d+; the checkpoint was written|pre-empted; the "
                          r"checkpoint was written)", got.stderr)
        assert len(said) == 1, context  # once, whatever the number of processes (issue 34: twice in 2-process runs)
        assert len(re.findall(r"received SIGINT: writing a checkpoint", both)) <= 1, context
        assert got.checkpoint, f"no checkpoints/latest.txt in {got.run_dir}: {context}"


#: Run in a new process by :func:`test_the_docs_commands_in_printed_order_each_find_their_folder`: each train
#: command's config composed in one shared working folder, its folder prepared as tools/run.py prepares it, then
#: left as a trained run leaves it (config.yaml and a checkpoint); each tool's checkpoint= must name a folder an
#: earlier command made. Prints one JSON object: the problems found, and the folder each train command used.
_PRINTED_ORDER = r'''
import json, os, sys
from sslkit.checkpoint import checkpoint_dir
from sslkit.config.compose import compose_config
from sslkit.launch.runfolder import RunFolderError, prepare_output_dir, write_config
problems, folders = [], {}
with open(sys.argv[1]) as f:
    steps = json.load(f)
for where, kind, args in steps:
    if kind == "tool":
        target = next((a.split("=", 1)[1] for a in args if a.startswith("checkpoint=")), None)
        if target and not os.path.isabs(target) and not os.path.isdir(target):
            problems.append(f"{where}: checkpoint={target}, which no command before it made")
        made = next((a.split("=", 1)[1] for a in args if a.startswith("output=") and "." in a.rsplit("/", 1)[-1]), None)
        if made and not os.path.isabs(made) and os.path.isdir(os.path.dirname(made) or "."):
            open(made, "ab").close()  # a file a later command reads (docs/adapt.md's model.pretrained=)
        continue
    cfg = compose_config(args)
    try:
        prepare_output_dir(cfg)
    except RunFolderError as exc:
        problems.append(f"{where}: {str(exc).splitlines()[0]}")
        continue
    write_config(cfg)
    ckpt = checkpoint_dir(cfg.output_dir)
    os.makedirs(ckpt, exist_ok=True)
    open(os.path.join(ckpt, "checkpoint_000000001.pt"), "wb").close()
    with open(os.path.join(ckpt, "latest.txt"), "w") as f:
        f.write("checkpoint_000000001.pt")
    folders[where] = str(cfg.output_dir)
print(json.dumps({"problems": problems, "folders": folders}))
'''


def _run_args(argv: list[str]) -> list[str]:
    """The config arguments of a train command (after ``tools/run.py`` or ``sslkit train``)."""
    for i, arg in enumerate(argv):
        if arg.endswith("tools/run.py") or (arg == "train" and i and argv[i - 1] == "sslkit"):
            return argv[i + 1:]
    raise AssertionError(f"not a train command: {argv}")


@pytest.mark.slow
def test_the_docs_commands_in_printed_order_each_find_their_folder(tmp_path: Path) -> None:
    """A user who runs the README's commands, then the docs', in the order printed, all in one working folder: no
    training command meets a folder that "holds a run of another config" (issue 34: after the main job, the README's
    own longer SimCLR, docs/vit.md's ViT SimCLR and docs/methods.md's annealed SimCLR all did), the same command
    finds its own folder again, and each tool's checkpoint= names a folder an earlier command made. Composed and
    prepared as tools/run.py does, without training (the test_doc_command cases train each one)."""
    steps, seen = [], set()
    for doc in DOC_FILES:
        for lineno, command in commands_in((REPO / doc).read_text(encoding="utf-8")):
            for pattern, value in EXPANSIONS.items():
                command = re.sub(rf"(?<!\S){re.escape(pattern)}(?!\S)", value, command)
            p = plan(command)
            if p.kind not in ("train", "tool"):
                continue
            args = _run_args(shlex.split(command)) if p.kind == "train" else shlex.split(command)
            args = [re.sub(r"^output_dir=/tmp/", "output_dir=tmp/", a) for a in args]  # kept in the folder
            steps.append((f"{doc}:{lineno}", p.kind, args))
            seen.add(p.kind)
    assert seen == {"train", "tool"} and len(steps) > 20
    _workdir(tmp_path, " ".join(f"imports=[{m}]" for m in MY_SSL))
    (tmp_path / "printed_order.py").write_text(_PRINTED_ORDER)  # forked from the tests' server, torch imported
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    proc = forkrun.run([sys.executable, "printed_order.py", "steps.json"], capture_output=True, text=True,
                       cwd=tmp_path, env=_run_env(tmp_path), timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["problems"] == [], "\n".join(found["problems"])
    folders = found["folders"]
    assert DOC_RUN in folders.values()  # the main job's, which the tools read
