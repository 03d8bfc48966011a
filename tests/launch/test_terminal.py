"""What a user sees: one progress bar per run, epoch lines, ETAs, the catalog, --help, did-you-mean, the recipe diff."""

from __future__ import annotations

import importlib
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tqdm
from helpers import make_task

from sslkit import registry as R
from sslkit.config import schema
from sslkit.config.compose import compose_config
from sslkit.config.diff import ABSENT, format_recipe_diff, recipe_diff
from sslkit.config.schema import ConfigError
from sslkit.hooks.base import SSLHook
from sslkit.hooks.logging import LogHook
from sslkit.launch.catalog import catalog_text, usage_text
from sslkit.task import Phase, SSLTask
from sslkit.train_steps.standard import standard_train_step
from sslkit.trainer import train

log_module = importlib.import_module("sslkit.hooks.logging")


@pytest.fixture
def terminal() -> Iterator[tuple[logging.StreamHandler, io.StringIO]]:
    """The ``sslkit`` logger writing to a StringIO only (as cli.setup_logging's stdout handler would)."""
    logger = logging.getLogger("sslkit")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    for handler in saved[0]:
        logger.removeHandler(handler)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield handler, out
    logger.removeHandler(handler)
    for h in saved[0]:
        logger.addHandler(h)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


class Clock(SSLHook):
    """Runs before the log hook (priority 0): every step takes ``seconds`` on the fake clock."""

    def __init__(self, seconds: float) -> None:
        self.now, self.seconds = 1000.0, seconds

    def __call__(self) -> float:
        return self.now

    def on_step(self, task: SSLTask) -> None:
        self.now += self.seconds


class ListSink:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def _two_epochs(hooks: list[SSLHook], eval_between: bool = False) -> SSLTask:
    """Two train epochs of 2 optimizer steps each (clock.max_steps 4), optionally an eval phase between."""
    phases = [Phase(train=True, epoch=0), Phase(train=True, epoch=1)]
    if eval_between:
        phases.insert(1, Phase(train=False, epoch=0, split="test"))
    task = make_task(phases, hooks)
    task.clock.max_steps = 4
    task.global_batch_size = 3
    return task


def test_one_bar_for_the_whole_run_and_log_lines_above_it(terminal, monkeypatch) -> None:
    handler, out = terminal
    through_tqdm: list[str] = []
    original_write = tqdm.tqdm.write

    def recording_write(cls, s, file=None, end="\n", nolock=False):
        through_tqdm.append(s)
        original_write(s, file=file, end=end, nolock=nolock)

    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(recording_write))
    bar_out = io.StringIO()
    hook = LogHook(every_n_steps=1, progress_bar=True, bar_file=bar_out)
    task = _two_epochs([hook], eval_between=True)
    train(task, standard_train_step)

    frames = [f for f in re.split(r"[\r\n]", bar_out.getvalue()) if f.strip()]
    counts = [re.search(r"(\d+)/(\d+) \[", f).groups() for f in frames]  # type: ignore[union-attr]
    assert {total for _, total in counts} == {"4"}  # one bar over the run's 4 steps, not 2 per epoch
    assert counts[-1] == ("4", "4")  # the eval phase did not move it past the train steps
    assert bar_out.getvalue().count("\n") == 1  # closed once, its last state left on screen
    assert hook._bar is None and handler.stream is out  # the handler got its own stream back

    text = out.getvalue()
    for step in range(1, 5):  # every interval line reached the terminal, through tqdm.write
        assert f"step {step}/4 loss" in text
        assert any(f"step {step}/4 loss" in s for s in through_tqdm)
    done = re.findall(r"^epoch (\d)/(\d) done: loss [\d.]+ lr 0.1 \d+ img/s, elapsed \S+, ETA \S+$", text, re.M)
    assert done == [("1", "2"), ("2", "2")]
    assert any("epoch 2/2 done" in s for s in through_tqdm)


def test_resumed_bar_starts_at_the_iteration(terminal) -> None:
    bar_out = io.StringIO()
    hook = LogHook(every_n_steps=1, progress_bar=True, bar_file=bar_out)
    task = _two_epochs([hook])
    task.phase_idx, task.clock.step = 1, 2  # resumed at the start of the second epoch
    train(task, standard_train_step)
    frames = [f for f in re.split(r"[\r\n]", bar_out.getvalue()) if f.strip()]
    assert re.search(r" 2/4 \[", frames[0]) and re.search(r" 4/4 \[", frames[-1])


def test_lines_without_a_bar_carry_elapsed_time_and_the_run_eta(terminal, monkeypatch) -> None:
    _, out = terminal
    clock, sink = Clock(seconds=2.0), ListSink()
    monkeypatch.setattr(log_module, "_now", clock)
    task = _two_epochs([clock, LogHook(every_n_steps=1, progress_bar=False, sinks=[sink])])
    train(task, standard_train_step)
    lines = out.getvalue().splitlines()

    # step s of 4 at 2 s per step: elapsed 2s, ETA (4 - s) x 2 s: the whole run, not the epoch
    for step, elapsed, eta in ((1, "0m02s", "0m06s"), (2, "0m04s", "0m04s"), (3, "0m06s", "0m02s"),
                               (4, "0m08s", "0m00s")):
        epoch = (step - 1) // 2
        assert any(re.fullmatch(rf"epoch {epoch} step {step}/4 loss [\d.]+ lr 0.1 2 img/s, elapsed {elapsed}, "
                                rf"ETA {eta}", line) for line in lines), (step, lines)
    epoch0 = [r["loss"] for r in sink.records if r["epoch"] == 0 and r["phase"] == "train"]
    assert f"epoch 1/2 done: loss {sum(epoch0) / 2:.4f} lr 0.1 2 img/s, elapsed 0m04s, ETA 0m04s" in lines
    assert [(r["elapsed_s"], r["eta_s"]) for r in sink.records] == [(2, 6), (4, 4), (6, 2), (8, 0)]


def test_exception_closes_the_bar_and_restores_the_stream(terminal) -> None:
    handler, out = terminal

    class Boom(SSLHook):
        def on_update(self, task: SSLTask) -> None:
            if task.clock.step == 1:
                raise RuntimeError("boom")

    bar_out = io.StringIO()
    hook = LogHook(every_n_steps=1, progress_bar=True, bar_file=bar_out)
    with pytest.raises(RuntimeError, match="boom"):
        train(_two_epochs([Boom(), hook]), standard_train_step)
    assert hook._bar is None and handler.stream is out
    assert bar_out.getvalue().endswith("\n")


def _sections(text: str) -> dict[str, dict[str, str]]:
    """catalog_text -> {header: {name: description}}."""
    sections: dict[str, dict[str, str]] = {}
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith(" "):
            rows = sections.setdefault(line, {})
        elif line.strip():
            name, _, desc = line.strip().partition(" ")
            rows[name] = desc.strip()
    return sections


def test_catalog_lists_every_recipe_preset_and_hook_with_a_description(tmp_path, monkeypatch) -> None:
    user = tmp_path / "config"
    user.mkdir()
    (user / "my_method.yaml").write_text("# @package _global_\n# My method (Doe et al. 2024), for tests. More\n"
                                         "# about it.\nseed: 1\n")
    monkeypatch.setattr(schema, "CONFIG_DIRS", [*schema.CONFIG_DIRS, tmp_path])
    sections = _sections(catalog_text())
    recipes = sections["recipes (config=NAME):"]
    shipped = {p.stem for p in (Path(schema.PACKAGE_CONFIG_DIR).parents[1] / "configs" / "config").glob("*.yaml")}
    assert set(recipes) == shipped | {"my_method"}
    assert recipes["my_method"] == "My method (Doe et al. 2024), for tests."  # first sentence, @package skipped
    assert recipes["simclr"].startswith("SimCLR")
    assert set(sections["data presets (data=NAME):"]) >= {"cifar10", "fashion_mnist", "folder", "synthetic"}
    hooks = sections["hooks (hooks=[{name: NAME}] adds one):"]
    assert set(hooks) == {name for name, _ in R.HOOKS}
    assert all(recipes.values()), recipes
    # sslkit's own registrations all say what they are (tests may register undocumented ones of their own)
    for kind, registry in (("hooks (hooks=[{name: NAME}] adds one):", R.HOOKS), ("losses (loss.name=NAME):", R.LOSSES)):
        own = {name for name, obj in registry if getattr(obj, "__module__", "").startswith("sslkit.")}
        assert own and all(sections[kind][name] for name in own), sections[kind]
    assert hooks["momentum_teacher"].startswith("After every optimizer update, move each teacher")
    methods = sections["methods (method.name=NAME):"]
    assert set(methods) == {name for name, _ in R.METHODS}
    assert methods["byol"].startswith("model byol, loss byol, simclr views; requires hooks: momentum_teacher.")


def test_usage_names_every_recipe_and_how_to_override() -> None:
    text = usage_text()
    assert text.startswith("usage: python tools/run.py")
    for path in (schema.CONFIG_DIRS[0] / "config").glob("*.yaml"):
        assert re.search(rf"^  {path.stem} +\S", text, re.M), path.stem
    for path in (schema.CONFIG_DIRS[0] / "data").glob("*.yaml"):
        assert re.search(rf"^  {path.stem} +\S", text, re.M), path.stem
    for needed in ("config=NAME", "data=NAME", "key=value", "+key=value", "~key", "sslkit/config/defaults.yaml",
                   "docs/configs.md", "SSLKIT_DEBUG=1", "--debug", "python -m sslkit list"):
        assert needed in text, needed


@pytest.mark.parametrize(("override", "suggestion"), [
    ("confg=simclr", "config"),
    ("dat=cifar10", "data"),
    ("optim.lrr=1", "optim.lr"),
    ("optim.wieght_decay=1", "optim.weight_decay"),
    ("optim.moment=0.9", "optim.momentum"),
    ("lr=0.1", "optim.lr"),
    ("+confg=simclr", "config"),
    ("xyz=1", None),
    ("optim.xyz=1", None),
    ("optim.l=1", None),
])
def test_did_you_mean_suggests_only_close_names(override: str, suggestion: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    message = str(info.value)
    assert "unknown config key" in message
    if suggestion is None:
        assert "Did you mean" not in message
    else:
        assert f"Did you mean '{suggestion}'?" in message


def test_recipe_diff_reports_only_what_the_run_changed() -> None:
    changed = ["config=simclr", "optim.lr=0.01", "name=x", "output_dir=/tmp/x", "+model.trunk_kwargs.width=8"]
    diff = recipe_diff(changed, compose_config(changed))
    assert sorted(diff, key=lambda d: d[0]) == [("model.trunk_kwargs.width", ABSENT, 8), ("optim.lr", 0.3, 0.01)]
    text = format_recipe_diff(changed, compose_config(changed))
    assert text.splitlines()[0] == "config: recipe simclr, data fashion_mnist; changed from them:"
    assert "  optim.lr 0.3 -> 0.01" in text.splitlines() and "/tmp/x/config.yaml" in text

    same = ["config=simclr", "data=synthetic"]
    assert recipe_diff(same, compose_config(same)) == []
    assert format_recipe_diff(same, compose_config(same)).startswith(
        "config: recipe simclr, data synthetic, as the recipe")


def test_list_into_a_reader_that_stops_early_is_not_an_error() -> None:
    """``sslkit list | head -1``: a closed pipe ends the listing quietly (exit 0, no BrokenPipeError traceback).
    The child's stdout is a pipe whose reader is already closed, so its very first write fails with EPIPE."""
    import subprocess
    import sys

    from helpers import HANG_S

    script = ("import os, sys\nr, w = os.pipe()\nos.close(r)\nos.dup2(w, 1)\n"
              "from sslkit.launch.cli import console\nsys.exit(console(['list']))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
