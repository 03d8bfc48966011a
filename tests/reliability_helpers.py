"""Shared pieces of the reliability tests: runs with fault injection, and exact state comparison."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from helpers import RECIPES, REPO, SMALL

HERE = Path(__file__).resolve().parent / "reliability"
#: tools/run.py finds the fault-injection hooks (imports=[sslkit_faults]) through this.
FAULT_ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{HERE}"}
if str(HERE) not in sys.path:  # and compose_config in this process too
    sys.path.insert(0, str(HERE))
#: Small runs: 96 synthetic images in batches of 16 = 6 steps per epoch, no kNN, no TensorBoard.
BASE = [*SMALL, "data.train.kwargs.num_samples=96", "eval.knn.enabled=false", "log.tensorboard=false",
        "imports=[sslkit_faults]", "checkpoint.keep_last=0"]
#: Per recipe: the overrides that make it small, as in the method tests.
RECIPE_ARGS = {
    "simclr": [],
    "moco": ["loss.queue_size=40"],
    "swav": ["loss.queue_length=32", "model.kwargs.num_prototypes=10", "data.transform.num_small=2"],
    "dino": ["data.transform.num_small=2", "model.head.bottleneck_dim=8"],
    # masks drawn from (seed, epoch, index), stochastic depth from the checkpointed RNG
    "mae": [*RECIPES["mae"], "model.trunk_kwargs.drop_path_rate=0.1"],
    # teachers, centres (iBOT's two, DINOv2's Sinkhorn-Knopp has none), block and multi-block masks, drop path
    "ibot": [*RECIPES["ibot"], "model.trunk_kwargs.drop_path_rate=0.1"],
    "dinov2": [*RECIPES["dinov2"], "model.trunk_kwargs.drop_path_rate=0.1"],
    "dinov3": [*RECIPES["dinov3"], "model.trunk_kwargs.drop_path_rate=0.1"],
    "ijepa": [*RECIPES["ijepa"], "model.trunk_kwargs.drop_path_rate=0.1"],
    # two students (a CNN with BatchNorm, a ViT with drop path), each with its own groups and clipping; the teacher
    # read from its file again on the resume
    "distill": [*RECIPES["distill"], "distill.students=[small_cnn, {trunk: vit_tiny, name: vit, trunk_kwargs: "
                "{patch_size: 8, depth: 1, num_heads: 2, drop_path_rate: 0.1}}]"],
}


def _render(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def hooks_override(recipe: str, *extra: dict[str, Any]) -> str:
    """``hooks=[...]`` with ``extra``: added hooks run with the recipe's own (``method.hooks``), which stay."""
    del recipe  # the recipe's hooks are not repeated: an override of ``hooks`` adds to them
    return "hooks=" + _render(list(extra))


def latest_state(out: Path) -> dict[str, Any]:
    from sslkit.checkpoint import Checkpointer

    path = Path(Checkpointer(str(out)).latest() or out / "checkpoints" / "latest.txt")
    if path.is_dir():  # a sharded checkpoint: read whole, optimizer included
        from sslkit.checkpointing.sharded import read_whole

        return read_whole(str(path), optimizer=True)
    return torch.load(path, map_location="cpu", weights_only=False)  # as the folder is read: on the CPU


def assert_identical(a: Any, b: Any, path: str = "state") -> None:
    """Exact equality (atol = rtol = 0) of two checkpoint states, tensor by tensor, with the path of
    the first difference in the message."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if not torch.equal(a, b):
            raise AssertionError(f"{path}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"{path}: arrays differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            if path == "state" and k == "config":
                continue  # the run's config as text: its output_dir and fault hooks differ between the runs compared
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def run_ranks_main(nproc: int, scratch: Path, *args: str) -> Any:
    """``tools/run.py args`` on ``nproc`` gloo processes spawned by this test process (``sslkit.launch.cli.main`` in
    each, as under torchrun): what :func:`helpers.run_cli` does with ``distributed.nproc_per_node``, without
    an interpreter for the launcher. Returns ``returncode`` and, as ``stdout``, the run's log.txt."""
    from types import SimpleNamespace

    from dist_workers import cli_main, run_ranks

    codes = run_ranks(cli_main, nproc, str(scratch), list(args))
    assert len(set(codes)) == 1, codes
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("output_dir=")))
    log = out / "log.txt"
    return SimpleNamespace(returncode=int(codes[0]) if codes[0].lstrip("-").isdigit() else codes[0],
                           stdout=log.read_text() if log.exists() else "")


def killed_at_10_resumes_identically(args: list[str], recipe: str, tmp: Path) -> None:
    """``args`` (a run of 2 epochs of 6 steps, a checkpoint every 4, ``imports=[sslkit_faults]``) SIGKILLed after step
    10 in a process of its own, then resumed from update 8 in this process: its end state equals an uninterrupted
    run's, bit for bit."""
    from helpers import run_cli, run_main

    ref, out = tmp / "ref", tmp / "killed"
    run_main(*args, hooks_override(recipe, {"name": "fault_signal", "step": 10**6}), f"output_dir={ref}")
    kill = hooks_override(recipe, {"name": "fault_signal", "step": 10, "signal": "SIGKILL"})
    assert run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV, check=False).returncode != 0
    assert latest_state(out)["position"]["step"] == 8
    assert "checkpoint_000000008.pt" in run_main(*args, kill, f"output_dir={out}").stdout
    assert_identical(latest_state(out), latest_state(ref))

