"""Exact resume: a run killed with SIGKILL mid-epoch and started again ends bit-identical to one never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli, run_main
from reliability_helpers import (
    BASE,
    FAULT_ENV,
    RECIPE_ARGS,
    assert_identical,
    hooks_override,
    latest_state,
    run_ranks_main,
)

# 2 epochs of 6 steps, a checkpoint every 4 steps: the kill after step 10 (epoch 1, 4 of 6 steps done)
# loses steps 9-10, which the resumed run must redo exactly (from the checkpoint of step 8, mid-epoch).
STEPS = ["optim.epochs=2", "checkpoint.every_n_steps=4"]


def _run_killed_and_resumed(tmp_path: Path, recipe: str, nproc: int, extra: list[str]) -> None:
    """The run SIGKILLed after step 10 is a process of its own (tools/run.py, with its own workers); the uninterrupted
    reference and the resumed run go through sslkit.launch.cli.main in this process (one process) or in processes it
    spawns (two): the same outcome, without the launcher's interpreter starts."""
    args = [f"config={recipe}", *BASE, *RECIPE_ARGS[recipe], *STEPS, *extra,
            f"distributed.nproc_per_node={nproc}", f"data.batch_size={16 // nproc}"]  # 6 steps per epoch
    never_fires = hooks_override(recipe, {"name": "fault_signal", "step": 10**6})
    kill_at_10 = hooks_override(recipe, {"name": "fault_signal", "step": 10, "signal": "SIGKILL"})

    def run(*more: str) -> object:  # (only the killed run needs an interpreter of its own)
        return run_main(*args, *more) if nproc == 1 else run_ranks_main(nproc, tmp_path / "ranks", *args, *more)

    reference = run(never_fires, f"output_dir={tmp_path / 'ref'}")
    assert "resumed" not in reference.stdout

    out = tmp_path / "killed"
    killed = run_cli(*args, kill_at_10, f"output_dir={out}", env=FAULT_ENV, check=False)
    assert killed.returncode != 0, "the run was supposed to die by SIGKILL"
    at_kill = latest_state(out)["position"]
    assert (at_kill["step"], at_kill["phase_idx"], at_kill["step_in_epoch"]) == (8, 1, 2)

    resumed = run(kill_at_10, f"output_dir={out}")
    assert "resumed from" in resumed.stdout and "checkpoint_000000008.pt" in resumed.stdout

    ref, again = latest_state(tmp_path / "ref"), latest_state(out)
    assert ref["position"]["step"] == 12
    assert len(ref["rng"]) == nproc  # every rank's RNG state is saved
    assert_identical(again, ref)


# Real processes killed by SIGKILL, for the recipes whose state is the most varied: simclr (model, optimizer,
# RNG; with loader workers, below) and, on 2 ranks, moco (shuffled BatchNorm across ranks) and swav (a per-rank
# queue, the prototype hook, the collapse window). Every recipe (the ViT ones too) is crashed and resumed in-process
# by tests/reliability/test_everyday.py::test_every_recipe_resumes_bit_identically (moco's queue, dino's centre
# and teacher included), which keeps the suite inside its time budget.
@pytest.mark.slow
def test_resume_is_bit_identical_with_loader_workers(tmp_path: Path) -> None:
    """Augmentations are seeded per (seed, epoch, index): worker processes change nothing."""
    _run_killed_and_resumed(tmp_path, "simclr", 1, ["data.num_workers=2"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["moco", "swav"])  # moco's shuffled BatchNorm across ranks, swav's per-rank queue
def test_sigkill_mid_epoch_resume_is_bit_identical_2_ranks(tmp_path: Path, recipe: str) -> None:
    _run_killed_and_resumed(tmp_path, recipe, 2, [])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mae", "dinov2", "dinov3", "ijepa"])  # ibot: dinov2's model; in test_everyday
def test_a_masked_vit_resumes_bit_identically_after_sigkill(tmp_path: Path, recipe: str) -> None:
    """The masked ViT recipes with stochastic depth: the masks come from each sample's (seed, epoch, index) and need
    no state, drop path draws from the RNG every rank checkpoints, the teachers, the centres and the momentum
    schedule are in the checkpoint; the run killed mid-epoch ends bit-identical."""
    _run_killed_and_resumed(tmp_path, recipe, 1, [])


@pytest.mark.slow
def test_dinov3_resumes_bit_identically_across_the_start_of_a_high_resolution_phase(tmp_path: Path) -> None:
    """A high-resolution phase from update 9, the Gram teacher on crops of its own size throughout: the run killed
    after step 10 resumes from the checkpoint of update 8, before the phase, and crosses its start again; the
    crops each update draws come from (seed, update), so the resumed run ends bit-identical."""
    _run_killed_and_resumed(tmp_path, "dinov3", 1, [
        "hires.start_step=9", "hires.global_sizes=[40,48]", "hires.local_sizes=[16,24]",
        "hires.teacher_sizes=[64,72]", "hires.ratios=[0.5,0.5]", "gram.teacher_size=48"])


@pytest.mark.slow
def test_a_distillation_resumes_every_student_bit_identically_after_sigkill(tmp_path: Path) -> None:
    """Two students trained on one teacher forward a step: the killed run's checkpoint holds both students, their
    optimizer groups and the teacher's digest (not the teacher); the resumed run reads the teacher from its file
    again and ends bit-identical, both students."""
    _run_killed_and_resumed(tmp_path, "distill", 1, [])
