"""The code in docs/ runs: the worked hook and train-step examples go through tools/run.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO, SMALL, run_cli


def python_block(doc: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / doc).read_text(), flags=re.S)
    assert len(blocks) == 1, f"{doc} should hold exactly one python example"
    return blocks[0]


@pytest.mark.slow
def test_hook_example_runs(tmp_path: Path) -> None:
    (tmp_path / "doc_hooks.py").write_text(python_block("hooks.md"))
    proc = run_cli("config=simclr", *SMALL, "optim.max_steps=4", "eval.knn.enabled=false",
                   "imports=[doc_hooks]", "hooks=[{name: embedding_std, every_n_steps: 2}]",
                   f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    stds = [float(m) for m in re.findall(r"embedding std ([0-9.]+)", proc.stdout)]
    assert len(stds) == 2 and all(0 < s <= 1 for s in stds)


@pytest.mark.slow
def test_hook_example_typo_is_named(tmp_path: Path) -> None:
    (tmp_path / "doc_hooks.py").write_text(python_block("hooks.md"))
    proc = run_cli("config=simclr", *SMALL, "imports=[doc_hooks]", "hooks=[{name: embedding_std, every_n_step: 2}]",
                   f"output_dir={tmp_path / 'run'}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    expected = "'hooks[0].every_n_step' is not an argument of EmbeddingStdHook. Did you mean 'every_n_steps'?"
    assert expected in proc.stderr


@pytest.mark.slow
def test_train_step_example_runs(tmp_path: Path) -> None:
    (tmp_path / "doc_steps.py").write_text(python_block("train_steps.md"))
    proc = run_cli("config=simclr", *SMALL, "optim.max_steps=4", "eval.knn.enabled=false",
                   "imports=[doc_steps]", "train_step=clipped", f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert "step 4/4" in proc.stdout
