"""Helpers shared by the tests: a tiny task for loop tests, and running tools/run.py as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import forkrun
import torch
from torch import nn
from torch.utils.data import DataLoader

import sslkit.launch.doctor as _doctor
from sslkit.hooks.base import SSLHook
from sslkit.optim.schedules import OnProgress
from sslkit.task import DataPlan, Phase, RunInfo, SSLTask, Training


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, views):
        return {"projections": [self.lin(v) for v in views]}


def tiny_loss(output, sample):
    return sum(p.pow(2).mean() for p in output["projections"])


class LossModule(nn.Module):
    def forward(self, output, sample, ctx=None):
        return tiny_loss(output, sample)


def make_task(phases: list[Phase], hooks: list[SSLHook], n: int = 6, batch: int = 3) -> SSLTask:
    """A linear model on ``n`` random 4-d inputs in batches of ``batch``; SGD lr 0.1."""
    torch.manual_seed(0)
    data = [{"input": [torch.randn(4)], "target": 0} for _ in range(n)]
    loader = DataLoader(data, batch_size=batch)
    model = TinyModel()
    return SSLTask(
        Training(model=model, loss=LossModule(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 lr_schedule=OnProgress(lambda where: 0.1)),
        DataPlan(loaders={"train": loader, "test": loader}, phases=phases), hooks, max_steps=100,
    )


REPO = Path(__file__).resolve().parents[1]
#: Small CPU runs. machine.device=cpu: these tests mean the CPU (exact values, gloo processes), also
#: where a GPU is visible; the GPU tests (tests/gpu, marker gpu) ask for CUDA themselves.
#: Every recipe small (synthetic 32 px images, a narrow trunk, tiny heads) on the CPU: sslkit doctor's settings,
#: one source for both.
SMALL = ["machine.device=cpu", *_doctor.SMALL]

#: A small ViT for the synthetic data's 32 px crops (4 x 4 patches; 16 px local crops 2 x 2), replacing SMALL's CNN.
VIT = list(_doctor._VIT)

#: Every recipe, with the overrides (on top of SMALL) that make it small: tests that run all of them.
RECIPES: dict[str, list[str]] = _doctor.SMALL_RECIPES


#: Seconds a test waits for an event (a file, a log line, an exit) before it calls what it waits on hung: a guard
#: against a hang, never a measure of speed. No test of the suite has a shorter deadline (tests/test_suite.py).
HANG_S = 600.0


def wait_for(condition: Callable[[], bool], what: str, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``condition()`` holds (polled every 50 ms). Fails naming ``what`` if ``proc`` ends first, or after
    :data:`HANG_S` seconds (then ``proc`` is hung: it is killed)."""
    end = time.monotonic() + HANG_S
    while not condition():
        if proc is not None and proc.poll() is not None:
            out = proc.communicate()
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}:\n{out}")
        if time.monotonic() > end:
            if proc is not None:
                proc.kill()
            raise AssertionError(f"waited {HANG_S:.0f} s for {what}: hung")
        time.sleep(0.05)


#: MAE in the paper's shape (ViT-S/16 at 224 px: 196 patches, 49 kept; a 512-d decoder) on synthetic 224 px images
#: (both splits: the test split's size is its own), 3 updates. Trained in bf16 by tests/gpu/test_vit_cuda.py; its
#: config is composed on the CPU too (tests/config/test_compose.py), so a new config check cannot break it unseen.
MAE_VIT_S16_224 = ["config=mae", *SMALL, "data.train.kwargs.image_size=224", "data.test.kwargs.image_size=224",
                   "data.image_size=224", "data.patch_size=16", "model.trunk=vit_small",
                   "model.trunk_kwargs={pos_embed: sincos}", "model.head.hidden_dim=null", "model.head.out_dim=null",
                   "model.kwargs.decoder_dim=512", "model.kwargs.decoder_depth=2", "model.kwargs.decoder_heads=16",
                   "optim.max_steps=3", "eval.knn.enabled=false"]


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": f"{cwd or REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **(env or {})}
    proc = forkrun.run([sys.executable, str(REPO / "tools" / "run.py"), *args], capture_output=True, text=True,
                       cwd=cwd or REPO, env=full_env, timeout=HANG_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def run_main(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """:func:`run_cli` in this process (``sslkit.launch.cli.main``, output captured): the same outcome without the
    seconds a new interpreter takes to import torch. For runs that need no process of their own (signals,
    environment, working directory, spawned workers)."""
    import contextlib
    import io
    import logging

    from sslkit.launch.cli import main

    logger = logging.getLogger("sslkit")  # put the logger back as it was (module fixtures run outside conftest's)
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for handler in list(logger.handlers):
            if handler not in handlers:
                logger.removeHandler(handler)
                handler.close()
        logger.propagate, logger.level = propagate, level
    proc = subprocess.CompletedProcess(["sslkit", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"exit {code}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def run_sslkit(*args: str) -> tuple[int, str, str]:
    """``sslkit ARGS`` (the console command: train, knn, linear, finetune, ...) in this process: (exit code,
    stdout, stderr)."""
    import contextlib
    import io

    from sslkit.launch.cli import console

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = console(list(args))
    return code, out.getvalue(), err.getvalue()


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]




class TinyTrunk(nn.Module):
    """Linear + BatchNorm on flattened 2x2 one-channel images; ``out_dim`` 6 (method wiring tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out_dim = 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.lin(x.flatten(1))))


def mlp(seed: int = 0) -> nn.Module:
    """A model without BatchNorm, so per-rank batches and one big batch compute the same thing."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))


class _ViewsMLP(nn.Module):
    """An MLP without BatchNorm applied to every view: ``{"projections": [...]}``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, views):
        return {"projections": [self.net(v) for v in views]}


class _PerSampleLoss(nn.Module):
    """Mean over the batch of a per-sample term: decomposes over samples, ranks and micro-batches."""

    def forward(self, output, sample, ctx=None):
        return (output["projections"][0] - 1.0).pow(2).sum(dim=1).mean()


def per_sample_task(rank: int = 0, world: int = 1, *, manual: bool = False, accumulate: int = 1,
                    steps: int = 3, global_batch: int = 8) -> SSLTask:
    """A task whose global batch of ``global_batch`` samples per step is split over ``world`` ranks
    and ``accumulate`` micro-batches, in a fixed order, so every split sees the same samples."""
    g = torch.Generator().manual_seed(123)
    x = torch.randn(steps * global_batch, 8, generator=g)
    per_rank = global_batch // world
    micro = per_rank // accumulate
    mine = [x[s * global_batch + rank * per_rank: s * global_batch + (rank + 1) * per_rank] for s in range(steps)]
    data = [{"input": [v], "target": 0} for chunk in mine for v in chunk]
    loader = DataLoader(data, batch_size=micro)
    model: nn.Module = _ViewsMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    return SSLTask(
        Training(model=model, loss=_PerSampleLoss(), optimizer=optimizer, lr_schedule=OnProgress(lambda where: 0.1),
                 global_batch_size=global_batch, micro_batches=accumulate, manual_gradient_reduction=manual),
        DataPlan(loaders={"train": loader}, phases=[Phase(train=True, epoch=0)]), [],
        run=RunInfo(rank=rank, world_size=world), max_steps=steps,
    )


def photo(h: int, w: int, seed: int) -> Any:
    """A smooth RGB picture of ``h`` x ``w`` (bilinear upsampling of 4 x 4 random colours)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(h, w), mode="bilinear")
    return Image.fromarray((smooth[0].permute(1, 2, 0) * 255).to(torch.uint8).numpy())


def photo_folder(root: Path, n: int = 24) -> None:
    """Class folders of JPEGs and PNGs of many sizes, one corrupt JPEG among them."""
    for i in range(n):
        folder = root / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        photo(24 + (i * 7) % 19, 20 + (i * 5) % 23, i).save(folder / f"{i}.{'png' if i % 5 == 0 else 'jpg'}")
    (root / "c1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 64)


def distillation_output(seed: int, b: int, m: int, k: int, masked: float) -> dict[str, Any]:
    """A random iBOT / DINOv2 model output: 4 crops (2 global), ``b`` images, ``m`` patch slots, ``k`` prototypes, each
    slot of a global crop masked with probability ``masked``; image 1 of crop 0 is left unmasked (it must add 0)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(2, b, m, generator=g) < masked).float()
    w[0, 1] = 0.0
    return {"features": [torch.randn(b, 8, generator=g) for _ in range(4)],
            "projections": [torch.randn(b, k, generator=g) for _ in range(4)],
            "targets": [torch.randn(b, k, generator=g) for _ in range(2)],
            "patch_projections": [torch.randn(b, m, k, generator=g) for _ in range(2)],
            "patch_targets": [torch.randn(b, m, k, generator=g) for _ in range(2)],
            "patch_weights": list(w)}


def ade_folder(root: Path, n_train: int = 4, n_test: int = 2, size: int = 32) -> Path:
    """A folder in ADE20K's layout: images with a bright square on a dark ground, the square class 2 and the ground
    class 1 in the class map (0, "other", on the border)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("training", n_train), ("validation", n_test)):
        (root / "images" / split).mkdir(parents=True)
        (root / "annotations" / split).mkdir(parents=True)
        for i in range(n):
            image = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
            mask = np.ones((size, size), dtype=np.uint8)
            top, left = rng.integers(2, size // 2, 2)
            image[top:top + size // 3, left:left + size // 3] = 220
            mask[top:top + size // 3, left:left + size // 3] = 2
            mask[0, :] = 0
            Image.fromarray(image).save(root / "images" / split / f"ADE_{i:04d}.jpg")
            Image.fromarray(mask).save(root / "annotations" / split / f"ADE_{i:04d}.png")
    return root


def pixels(shape: tuple[int, ...], dtype: type, seed: int) -> Any:
    """Random integer pixels of ``dtype`` (uint8, uint16) over its whole range, seeded: a NumPy array."""
    import numpy as np

    top = np.iinfo(dtype).max
    return np.random.default_rng(seed).integers(0, top, size=shape, endpoint=True).astype(dtype)


def four_channel_folder(root: Path) -> None:
    """Two classes of 4-channel 16-bit 32 px .npy images, 12 each (class 1 brighter in its last channel)."""
    import numpy as np

    for c in range(2):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(12):
            x = pixels((32, 32, 4), np.uint16, 10 * c + i) // 2
            x[..., 3] += np.uint16(30000 * c)
            np.save(root / f"class{c}" / f"{i}.npy", x)


#: A small SimCLR run on tar shards (data=webdataset): its CNN, heads and crops sized for the test images.
SMALL_WDS = ["config=simclr", "data=webdataset", "machine.device=cpu", "model.trunk=small_cnn",
             "model.trunk_kwargs={width: 8}", "model.head.hidden_dim=32", "model.head.out_dim=16", "data.image_size=32",
             "data.small_image_size=16", "eval.knn.k=5", "log.tensorboard=false", "log.report=false"]


def four_shards(root: Path) -> Path:
    """128 PNGs of 20 px (labels i % 3) packed into 4 shards of 32 (``part{j}-000000.tar``) under ``root/shards``: the
    elastic-resume tests' set, where a window of 2 shards is 2 global batches of 32."""
    import numpy as np
    from PIL import Image

    from sslkit.data.shards import pack_images

    images = root / "images"
    images.mkdir(parents=True)
    files = []
    for i in range(128):
        pixels = (np.random.default_rng(i).random((20, 20, 3)) * 255).astype(np.uint8)
        files.append((str(images / f"{i}.png"), i % 3))
        Image.fromarray(pixels).save(files[-1][0])
    for j in range(4):
        pack_images(files[32 * j:32 * (j + 1)], root / "shards", prefix=f"part{j}")
    return root / "shards"
