"""On CUDA: the paper-scale recipes (DINOv2, iBOT, I-JEPA at ViT-S/16 and ViT-B/16, 224 px) at their real size.

Marked ``gpu``: skipped where no CUDA device is visible (CI). Each recipe trains a few bf16 updates at its own
per-process batch (sslkit doctor's settings: synthetic 224 px images, nothing else changed), with CUDA's sync debug
mode raising on any host-device sync in updates 3-5, and its peak memory is printed (``-rP``) and written as a JSON
line to ``$SSLKIT_GPU_REPORT`` when set. One such run at a time, also under ``pytest -n 8``
(one xdist group): two ViT-B or ViT-L steps beside each other outgrow one GPU's memory. The CPU checks of the same
recipes: tests/methods/test_paper_recipes.py.
"""

from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path

import pytest
import torch

from sslkit.launch.doctor import PAPER, PAPER_RECIPES

# one xdist group (the suite runs --dist loadgroup): the paper runs take turns on one worker
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group(name="gpu-paper-recipes")]

GPU = ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16"]
#: The recipes whose step is too large for the CPU suite's 4 GB a process (tests/methods/test_paper_recipes.py), with
#: their Gram teacher from the first update as sslkit doctor's dinov3_vits16: ViT-B at the 128 images a Sinkhorn-Knopp
#: over 65536 prototypes needs (256 teacher rows), ViT-L at 32 with centring (as benchmarks/throughput.py's preset).
GPU_ONLY = {"dinov3_vitb16": ["data.batch_size=128", "gram.start_step=0"],
            "dinov3_vitl16": ["data.batch_size=32", "gram.start_step=0", "loss.centering=centering"]}


@pytest.mark.parametrize("recipe", [*PAPER_RECIPES, *GPU_ONLY])
def test_paper_recipe_trains_at_its_real_size_in_bf16_without_a_sync(tmp_path: Path, recipe: str) -> None:
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    steps = 5
    own = PAPER_RECIPES.get(recipe, GPU_ONLY.get(recipe, []))
    cfg = compose_config([f"config={recipe}", *PAPER, *own, *GPU, f"optim.max_steps={steps}",
                          "log.every_n_steps=100", "eval.knn.enabled=false", "log.tensorboard=false",
                          "checkpoint.every_n_epochs=0", "checkpoint.auto_resume=false", f"output_dir={tmp_path}"])
    assert cfg.data.image_size == 224 and cfg.model.trunk_kwargs.patch_size == 16
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    task = build_task(cfg)
    assert tuple(task.base_model.trunk.patch_embed.grid_size) == (224 // 16, 224 // 16)  # (RoPE ViTs: no table)
    done = {"n": 0}
    losses: list[torch.Tensor] = []

    def watched(task) -> None:
        done["n"] += 1
        if done["n"] <= 2:  # the first updates may sync (cuDNN autotuning, first allocations)
            standard_train_step(task)
        else:
            torch.cuda.set_sync_debug_mode("error")
            try:
                standard_train_step(task)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        losses.append(task.last_batch.loss.detach())

    failure = ""
    try:
        train(task, watched)
    except Exception as exc:  # failed without its traceback: its frames would keep this run's GPU memory held
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        task.close()
    if failure:
        del task, watched
        gc.collect()
        torch.cuda.empty_cache()
        pytest.fail(failure, pytrace=False)
    assert task.clock.step == steps
    values = [float(v) for v in losses]
    assert all(math.isfinite(v) for v in values), values
    peak, total = torch.cuda.max_memory_allocated(), torch.cuda.mem_get_info()[1]
    row = {"recipe": recipe, "batch": task.global_batch_size, "peak_gib": round(peak / 2**30, 2),
           "gpu_gib": round(total / 2**30, 1), "gpu": torch.cuda.get_device_name(), "losses": values}
    print(json.dumps(row))
    if os.environ.get("SSLKIT_GPU_REPORT"):
        with open(os.environ["SSLKIT_GPU_REPORT"], "a") as f:
            f.write(json.dumps(row) + "\n")
