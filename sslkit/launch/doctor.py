"""``sslkit doctor``: is this machine ready to train? Versions, devices, a collective, every recipe, determinism.

    sslkit doctor [--device auto|cpu|cuda] [--recipes simclr,dino_vit,...] [--steps 3] [--no-collective]

Each check prints one row of a table (``ok``, ``FAILED`` or ``skipped``, and what it measured) and the exit status
is 0 only when none failed:

* **machine**: python, torch (and its CUDA, cuDNN, NCCL), each GPU (name, memory, compute capability, bf16), the
  libraries sslkit uses and the optional ones (each missing one with what it is for);
* **collective**: 2 processes in a process group (gloo on the CPU, NCCL when 2 GPUs are here) all-reduce and
  broadcast a tensor; the values are checked and the time of a 64 MiB all-reduce reported;
* **recipe <name>**: each recipe, small (synthetic 32 px images, a narrow trunk), ``--steps`` updates on the device
  under bf16 autocast on CUDA: finite losses, and the time per step;
* **paper <name>** (CUDA only): each paper-scale recipe (``dinov2_vits16`` ... ``ijepa_vitb16``) at its real size
  (224 px, its heads, crops and per-process batch) on synthetic 224 px images, ``--steps`` bf16 updates: finite
  losses, the time per step and the GPU's peak memory (what ``data.batch_size`` this GPU holds);
* **deterministic**: a small dino_vit (a ViT with a teacher, multi-crop) twice under
  ``machine.deterministic=true``: the weights after ``--steps`` updates compared tensor by tensor;
* **data vs step**: the simclr recipe on its own data (Fashion-MNIST when installed) for 20 updates: the share of
  the step's time spent waiting for data (``read_sample``), and img/s.

Ctrl-C or SIGTERM stops the doctor (its checks' runs are not pre-empted and resumed as training runs are): the table
of the checks done so far, exit 130 or 143.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sslkit.errors import EXIT_INTERRUPTED

__all__ = ["PAPER", "PAPER_RECIPES", "SMALL", "SMALL_RECIPES", "SMALL_TEACHER", "Check", "main", "small_teacher"]

#: Overrides that make any recipe small: synthetic 32 px images, a narrow trunk, tiny heads, no loader workers.
SMALL = [
    "data=synthetic", "data.train.kwargs.num_samples=64", "data.batch_size=16", "data.num_workers=0",
    "model.head.hidden_dim=32", "model.head.out_dim=16", "model.trunk_kwargs={width: 8}",
    "log.every_n_steps=2", "eval.knn.batch_size=32", "eval.knn.k=5", "log.report=false",
]
#: A small ViT for the synthetic data's 32 px crops (4 x 4 patches; 16 px local crops 2 x 2), replacing SMALL's CNN.
_VIT = ["model.trunk_kwargs={patch_size: 8, depth: 2, num_heads: 2}"]
#: Every recipe, with the overrides (on top of :data:`SMALL`) that make it small.
SMALL_RECIPES: dict[str, list[str]] = {
    "simclr": [],
    "moco": ["loss.queue_size=40"],
    "mocov3": ["model.kwargs.predictor_hidden_dim=32"],
    "byol": ["model.kwargs.predictor_hidden_dim=32"],
    "simsiam": ["model.kwargs.predictor_hidden_dim=8"],
    "swav": ["loss.queue_length=16", "loss.queue_start_step=0", "model.kwargs.num_prototypes=10",
             "data.transform.num_small=2"],
    "dino": ["data.transform.num_small=2", "model.head.bottleneck_dim=8"],
    "barlow_twins": [],
    "vicreg": [],
    "mae": [*_VIT, "model.head.hidden_dim=null", "model.head.out_dim=null", "model.kwargs.decoder_dim=32",
            "model.kwargs.decoder_depth=1", "model.kwargs.decoder_heads=2"],
    "lejepa": [*_VIT, "data.transform.num_small=2", "data.small_image_size=16", "loss.num_slices=16"],
    "dino_vit": [*_VIT, "data.transform.num_small=2", "data.small_image_size=16", "model.head.bottleneck_dim=8"],
    "mocov3_vit": [*_VIT, "model.kwargs.predictor_hidden_dim=32"],
    "simclr_vit": [*_VIT],
    "ibot": [*_VIT, "data.transform.num_small=2", "data.small_image_size=16", "model.head.bottleneck_dim=8"],
    # Sinkhorn-Knopp (the recipe centres, as ibot)
    "dinov2": [*_VIT, "data.transform.num_small=2", "data.small_image_size=16", "model.head.bottleneck_dim=8",
               "loss.centering=sinkhorn_knopp"],
    # timm's DINOv3 trunk (4 register tokens), the Gram teacher a snapshot before update 1, refreshed every update
    "dinov3": ["model.trunk_kwargs={patch_size: 8, depth: 2, num_heads: 2, embed_dim: 32}",
               "data.transform.num_small=2", "data.small_image_size=16", "model.head.bottleneck_dim=8",
               "gram.start_step=1", "gram.every=1", "gram.ramp_steps=0"],
    "ijepa": ["model.trunk_kwargs={patch_size: 4, depth: 2, num_heads: 2}", "model.head.hidden_dim=null",
              "model.head.out_dim=null", "model.kwargs.predictor_dim=16", "model.kwargs.predictor_depth=1"],
}
#: The small distillation's teacher: a 2-block ViT-tiny of fresh weights (seed 0), written once as a weights file by
#: :func:`small_teacher` (the doctor and the tests call it before they compose the recipe).
SMALL_TEACHER = os.path.join(tempfile.gettempdir(), "sslkit-small-teacher-v1.safetensors")
_TEACHER_TRUNK = ["distill.teacher_trunk=vit_tiny",
                  "distill.teacher_trunk_kwargs={patch_size: 8, depth: 2, num_heads: 2}"]
#: distill: that teacher into the small CNN (feature objective, its dense term from the CNN's map to the 4 x 4 patches)
SMALL_RECIPES["distill"] = [f"distill.teacher={SMALL_TEACHER}", *_TEACHER_TRUNK,
                            "distill.students=[{trunk: small_cnn, trunk_kwargs: {width: 8}}]"]


def small_teacher() -> str:
    """Write :data:`SMALL_TEACHER` unless it is there (atomically: a file any process finds is whole); its path."""
    if os.path.exists(SMALL_TEACHER):
        return SMALL_TEACHER
    import torch
    from safetensors.torch import save_file

    import sslkit.models  # noqa: F401  (registrations)
    from sslkit import registry as R

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    trunk = R.get(R.TRUNKS, "vit_tiny")(in_channels=3, img_size=32, patch_size=8, depth=2, num_heads=2)
    torch.random.set_rng_state(state)
    partial = f"{SMALL_TEACHER}.{os.getpid()}.part"
    save_file({k: v.contiguous() for k, v in trunk.state_dict().items()}, partial)
    os.replace(partial, SMALL_TEACHER)
    return SMALL_TEACHER
#: Overrides that put a paper-scale recipe on synthetic 224 px images, its sizes kept (crops, patches, heads, batch).
PAPER = ["data=synthetic", "data.train.kwargs.image_size=224", "data.test.kwargs.image_size=224",
         "data.train.kwargs.num_samples=1024", "data.image_size=224", "data.small_image_size=96",
         "data.patch_size=16", "log.report=false"]
#: The paper-scale recipes at their own per-process batch, but DINOv2's: its Sinkhorn-Knopp needs 256 teacher rows
#: a solve for 65536 prototypes, so one process takes data.batch_size=128 (what the config check asks of one GPU).
PAPER_RECIPES: dict[str, list[str]] = {
    "dinov2_vits16": ["data.batch_size=128"], "dinov2_vitb16": ["data.batch_size=128"],
    "ibot_vits16": [], "ibot_vitb16": [], "ijepa_vits16": [], "ijepa_vitb16": [],
    # DINOv3's ViT-S/16 with its Gram teacher from the first update (the recipe starts it at 5/6 of an ImageNet run)
    "dinov3_vits16": ["data.batch_size=128", "gram.start_step=0"],
}

#: Libraries sslkit uses (required), and optional ones with what they are for.
REQUIRED = ("torchvision", "timm", "omegaconf", "hydra", "fvcore", "iopath", "safetensors", "numpy", "PIL")
OPTIONAL = {"submitit": "launcher=slurm", "onnxruntime": "sslkit export's ONNX check",
            "umap": "UMAP plots of features", "kornia": "benchmarks/throughput.py --tools",
            "tensorboard": "log.tensorboard"}
#: The distribution of an optional module, where its name differs (its version is read without importing it: umap's
#: import alone compiles for about 5 s).
DISTRIBUTIONS = {"umap": "umap-learn"}


@dataclass
class Check:
    """One row of the table."""

    name: str
    status: str  # ok | FAILED | skipped | info
    detail: str
    #: What to change, for a check that failed (or passed with a warning).
    advice: str = ""


def _version(module: str) -> str | None:
    """The version of ``module`` once imported (a required one must import), or None."""
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as exc:
        if _torchvision_failed(exc):
            raise
        return None


def _torchvision_failed(exc: BaseException) -> bool:
    from sslkit.launch.runtime import pair_problem

    return pair_problem(exc) is not None


def _installed(module: str) -> str | None:
    """The installed version of an optional ``module`` from its distribution's metadata, without importing it; None
    where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    if find_spec(module) is None:
        return None
    try:
        return version(DISTRIBUTIONS.get(module, module))
    except PackageNotFoundError:
        return "installed"


def pair_check() -> Check:
    """torchvision: installed, the release of this torch, and loading with it."""
    from sslkit.launch.runtime import pair_note, pair_problem, torch_pair

    torch_v, vision_v = torch_pair()
    if vision_v is None:
        return Check("torchvision", "FAILED", "missing: pip install -e . installs it")
    try:
        importlib.import_module("torchvision")
    except Exception as exc:
        return Check("torchvision", "FAILED", f"{vision_v} with torch {torch_v}: does not load",
                     pair_problem(exc) or _why(exc))
    note = pair_note(torch_v, vision_v)
    if note:
        return Check("torchvision", "FAILED", f"{vision_v} with torch {torch_v}: loads, but {note}",
                     "pip install --force-reinstall torch torchvision (a matched pair); the mismatch may fail in "
                     "an operator later")
    return Check("torchvision", "ok", f"{vision_v}, the release for torch {torch_v}")


def machine_checks() -> list[Check]:
    """Versions and devices."""
    import torch

    rows = [Check("python", "info", f"{platform.python_version()} on {platform.platform()}, "
                                    f"{os.cpu_count()} CPU core(s)")]
    cuda = torch.version.cuda or "none"
    rows.append(Check("torch", "info", f"{torch.__version__} (CUDA {cuda}, cuDNN "
                                       f"{torch.backends.cudnn.version() if torch.cuda.is_available() else '-'})"))
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        rows.append(Check("NCCL", "info", nccl))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append(Check(f"cuda:{i}", "info", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute "
                                                   f"{p.major}.{p.minor}, bf16 "
                                                   f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}"))
    else:
        rows.append(Check("GPU", "info", "none visible (torch.cuda.is_available() is False): training runs on the "
                                         "CPU"))
    rows.append(pair_check())
    for module in REQUIRED[1:]:
        try:
            v = _version(module)
        except Exception:
            rows.append(Check(module, "FAILED", "does not load: it imports torchvision (the torchvision row)"))
            continue
        rows.append(Check(module, "ok" if v else "FAILED", v or "missing: pip install -e . installs it"))
    for module, purpose in OPTIONAL.items():
        v = _installed(module)
        rows.append(Check(module, "info", v or f"not installed (optional: {purpose})"))
    return rows


def _collective_worker(rank: int, world: int, port: int, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        x = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(x)
        ok = bool(torch.all(x == sum(range(1, world + 1))).item())
        y = torch.arange(4.0, device=device) * (rank + 1)
        dist.broadcast(y, src=0)
        ok = ok and bool(torch.equal(y.cpu(), torch.arange(4.0)))
        big = torch.ones(16 * 2**20, device=device)  # 64 MiB of float32
        dist.all_reduce(big)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(big)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / 3
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{int(ok)} {seconds}")
    finally:
        dist.destroy_process_group()


def collective_check() -> Check:
    """2 processes all-reduce and broadcast; the values checked, a 64 MiB all-reduce timed."""
    import torch

    from sslkit.distributed import find_free_port, start_processes

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        try:
            start_processes(_collective_worker, (2, find_free_port(), backend, out), 2, preload=("torch",))
            ok, seconds = open(out).read().split()
        except Exception as exc:  # a firewall, a broken NCCL: say it, go on with the other checks
            return Check("collective", "FAILED", f"2 processes over {backend}: {type(exc).__name__}: "
                                                 f"{str(exc).strip().splitlines()[-1][:200]}",
                         "processes on this machine cannot reach each other on 127.0.0.1: a firewall or a container "
                         "without loopback; for NCCL, NCCL_DEBUG=INFO says why (NCCL_SOCKET_IFNAME, NCCL_P2P_DISABLE)")
    if ok != "1":
        return Check("collective", "FAILED", f"2 processes over {backend}: wrong values after all-reduce/broadcast")
    note = "" if backend == "nccl" else (" (one GPU: NCCL between GPUs not checked)" if torch.cuda.is_available()
                                         else "")
    return Check("collective", "ok", f"2 processes over {backend}: all-reduce and broadcast right; 64 MiB "
                                     f"all-reduce {float(seconds) * 1e3:.1f} ms{note}")


def _train(args: list[str]) -> Any:
    """Compose ``args``, build the task and train it; the task."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    cfg = compose_config(args)
    os.makedirs(cfg.output_dir, exist_ok=True)
    task = build_task(cfg)
    try:
        train(task, standard_train_step)
    finally:
        task.close()
    return task


def _device_args(device: str) -> list[str]:
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16"] if cuda else ["machine.device=cpu"]


def _quiet_args(out: str, steps: int) -> list[str]:
    # no pre-emption handling: a check's run is not resumed, so Ctrl-C or SIGTERM stops the doctor, not the check
    return [f"optim.max_steps={steps}", "eval.knn.enabled=false", "log.tensorboard=false", "log.report=false",
            "checkpoint.every_n_epochs=0", "checkpoint.auto_resume=false", "reliability.preemption_signals=[]",
            f"output_dir={out}"]


def recipe_check(recipe: str, device: str, steps: int, root: str) -> Check:
    """``steps`` updates of the small recipe on the device: finite losses, time per step."""
    args = [f"config={recipe}", *SMALL, *SMALL_RECIPES[recipe], *_device_args(device),
            *_quiet_args(os.path.join(root, recipe), steps)]
    t0 = time.perf_counter()
    try:
        task = _train(args)
    except Exception as exc:
        return Check(f"recipe {recipe}", "FAILED", _why(exc), f"python tools/run.py config={recipe} shows the whole "
                     f"error; python tools/audit.py config={recipe} checks its step for CUDA hazards on any CPU")
    seconds = time.perf_counter() - t0
    loss = float(task.last_batch.loss.detach().float().cpu()) if task.last_batch.loss is not None else math.nan
    if task.clock.step != steps or not math.isfinite(loss):
        return Check(f"recipe {recipe}", "FAILED", f"{task.clock.step} of {steps} updates, last loss {loss}",
                     "a non-finite loss on this device: report it with the output of sslkit doctor")
    return Check(f"recipe {recipe}", "ok", f"{steps} updates on {task.device}, last loss {loss:.4f}, "
                                           f"{seconds / steps:.2f} s per update (build included)")


def paper_check(recipe: str, device: str, steps: int, root: str) -> Check:
    """``steps`` bf16 updates of a paper-scale recipe at its real size on CUDA: finite losses, time, peak memory."""
    import torch

    name = f"paper {recipe}"
    if "machine.device=cuda" not in _device_args(device):
        return Check(name, "skipped", "CUDA only: at 224 px with its heads and batch a CPU update takes minutes")
    args = [f"config={recipe}", *PAPER, *PAPER_RECIPES[recipe], *_device_args(device),
            *_quiet_args(os.path.join(root, recipe), steps)]
    from sslkit.guard import OutOfMemoryHalt

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        task = _train(args)
    except (torch.OutOfMemoryError, OutOfMemoryHalt):
        return Check(name, "FAILED", f"out of memory on this {_gib(torch.cuda.mem_get_info()[1])} GiB GPU at the "
                                     f"recipe's batch ({' '.join(PAPER_RECIPES[recipe]) or 'its data.batch_size'})",
                     "set model.activation_checkpointing=true, lower data.batch_size (the lr follows it), or shard "
                     "over more GPUs (distributed.strategy=fsdp)")
    except Exception as exc:
        return Check(name, "FAILED", _why(exc), f"python tools/run.py config={recipe} data=synthetic shows the whole "
                                                "error")
    seconds = time.perf_counter() - t0
    loss = float(task.last_batch.loss.detach().float().cpu()) if task.last_batch.loss is not None else math.nan
    if task.clock.step != steps or not math.isfinite(loss):
        return Check(name, "FAILED", f"{task.clock.step} of {steps} updates, last loss {loss}",
                     "a non-finite loss on this device: report it with the output of sslkit doctor")
    peak, total = torch.cuda.max_memory_allocated(), torch.cuda.mem_get_info()[1]
    return Check(name, "ok", f"{steps} updates of data.batch_size={task.global_batch_size} at 224 px, last loss "
                             f"{loss:.4f}, {seconds / steps:.2f} s per update (build included), peak memory "
                             f"{_gib(peak)} of {_gib(total)} GiB")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def determinism_check(device: str, steps: int, root: str) -> Check:
    """A small dino_vit twice under machine.deterministic=true: identical weights?"""
    import torch

    states = []
    for i in range(2):
        args = ["config=dino_vit", *SMALL, *SMALL_RECIPES["dino_vit"], *_device_args(device),
                "machine.deterministic=true", *_quiet_args(os.path.join(root, f"det{i}"), steps)]
        try:
            task = _train(args)
        except Exception as exc:
            return Check("deterministic", "FAILED", _why(exc))
        states.append({k: v.detach().cpu().clone() for k, v in task.base_model.state_dict().items()})
    differ = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    if differ:
        worst = max((states[0][k].double() - states[1][k].double()).abs().max().item() for k in differ)
        return Check("deterministic", "FAILED", f"dino_vit twice: {len(differ)} of {len(states[0])} tensors differ "
                                                f"(max {worst:.2e}), e.g. {differ[0]}",
                     "an op without a deterministic kernel on this device/version: machine.deterministic runs are "
                     "not run-to-run identical here (docs/reliability.md); report it with this output")
    return Check("deterministic", "ok", f"dino_vit twice, {steps} updates: all {len(states[0])} tensors "
                                        "identical")


def data_check(device: str, root: str, steps: int = 20) -> Check:
    """The simclr recipe on its own data: the share of the step spent waiting for data, and img/s."""
    args = ["config=simclr", *_device_args(device), *_quiet_args(os.path.join(root, "data"), steps)]
    try:
        task = _train(args)
    except Exception as exc:
        return Check("data vs step", "skipped" if "fashion" in str(exc).lower() else "FAILED",
                     _why(exc))
    stats = task.perf_stats
    stats.resolve()
    total = sum(stats.totals.values()) or 1.0
    wait = stats.totals.get("read_sample", 0.0) / total
    rate = f", {steps * task.global_batch_size / total:.0f} img/s"
    verdict = "the data loader keeps up" if wait < 0.2 else "data-bound: the step waits for data"
    advice = "" if wait < 0.2 else ("more loader workers (data.num_workers), augmentation on the device "
                                    "(data.augment_on=device, data.decode_on=device for JPEGs), docs/data.md")
    return Check("data vs step", "ok", f"simclr on its data, {steps} updates: {wait:.0%} of the step waiting for "
                                       f"data{rate} ({verdict})", advice)


def _why(exc: BaseException) -> str:
    """An error in one line: its type and message, whitespace collapsed, at most 300 characters."""
    if _torchvision_failed(exc):
        return "torchvision does not load with this torch (the torchvision row says what to install)"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def table(rows: list[Check]) -> str:
    """The checks as an aligned text table; under a row, what to change (``-> ...``) where there is something."""
    width = max(len(r.name) for r in rows)
    lines = []
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.status:<7}  {r.detail}")
        if r.advice:
            lines.append(f"{'':<{width}}  {'':<7}  -> {r.advice}")
    return "\n".join(lines)


class Stopped(BaseException):
    """SIGTERM during the checks (a BaseException, as KeyboardInterrupt: no check's ``except Exception`` takes it)."""


#: The signals that came during the checks. A signal sent to the whole process group (a terminal's Ctrl-C,
#: ``timeout``, a scheduler) also ends a check's data workers, and the loader's error raised while the run closes
#: replaces the Stopped raised here: the check then returns as failed, and this list still says why.
_SIGNALLED: list[int] = []


def _stop(signum: int, frame: Any) -> None:
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt() if signum == signal.SIGINT else Stopped()


def main(argv: list[str] | None = None) -> int:
    """``sslkit doctor``; returns 0 when no check failed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="sslkit doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the recipes train (auto: CUDA when visible, else the CPU)")
    parser.add_argument("--recipes", default=",".join([*SMALL_RECIPES, *PAPER_RECIPES]),
                        help="the recipes to train a few updates each, comma-separated (default: all; the "
                             "paper-scale ones, e.g. dinov2_vits16, at their real size on CUDA only)")
    parser.add_argument("--steps", type=int, default=3, help="updates per recipe and per deterministic run")
    parser.add_argument("--no-collective", action="store_true", help="skip the 2-process check")
    parser.add_argument("--no-data", action="store_true", help="skip the data vs step check")
    a = parser.parse_args(argv)
    import logging

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("sslkit doctor: error: --device cuda, but no CUDA device is visible (torch.cuda.is_available() is "
              "False): check the driver (nvidia-smi) and that this torch was built with CUDA, or use --device cpu",
              file=sys.stderr)
        return 2
    recipes = [r.strip() for r in a.recipes.split(",") if r.strip()]
    known = [*SMALL_RECIPES, *PAPER_RECIPES]
    unknown = [r for r in recipes if r not in known]
    if unknown:
        from sslkit.errors import did_you_mean

        print(f"sslkit doctor: error: unknown recipe {unknown[0]}.{did_you_mean(unknown[0], known)} "
              f"The recipes: {', '.join(known)}", file=sys.stderr)
        return 2
    logging.getLogger("sslkit").setLevel(logging.WARNING)  # the checks' own training logs are not the report
    small_teacher()
    rows = machine_checks()
    steps: list[Callable[[str], Check]] = []
    if not a.no_collective:
        steps.append(lambda _root: collective_check())
    steps += [lambda root, r=r: (paper_check if r in PAPER_RECIPES else recipe_check)(r, a.device, a.steps, root)
              for r in recipes]
    steps.append(lambda root: determinism_check(a.device, a.steps, root))
    if not a.no_data:
        steps.append(lambda root: data_check(a.device, root))
    total = len(rows) + len(steps)
    print(f"sslkit doctor: {total} checks; the table follows when they are done", flush=True)
    _SIGNALLED.clear()
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with tempfile.TemporaryDirectory(prefix="sslkit-doctor-") as root:
            for i, step in enumerate(steps):
                row = step(root)
                if _SIGNALLED:  # the check ended by the signal (its row, if any, says only how)
                    raise Stopped()
                rows.append(row)
                _progress(i + 1, len(steps), rows[-1])
    except (KeyboardInterrupt, Stopped):
        _progress(0, 0, None)
        term = _SIGNALLED[:1] == [signal.SIGTERM]
        print(f"\n{table(rows)}\n\nsslkit doctor: stopped by {'SIGTERM' if term else 'Ctrl-C'} with {len(rows)} "
              f"of {total} checks done", file=sys.stderr)
        return 128 + signal.SIGTERM if term else EXIT_INTERRUPTED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    _progress(0, 0, None)
    failed = [r.name for r in rows if r.status == "FAILED"]
    print(f"\n{table(rows)}\n\n{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


def _progress(done: int, total: int, row: Check | None) -> None:
    """On a terminal, one line on stderr that each check overwrites (the table holds the results: nothing is
    printed twice); ``row`` None clears it. Nothing when stderr is a file or a pipe."""
    if not sys.stderr.isatty():
        return
    line = "" if row is None else f"  {done}/{total} {row.name}: {row.status}"
    print(f"\r\033[K{line[:120]}", end="" if row is not None else "\r", file=sys.stderr, flush=True)
