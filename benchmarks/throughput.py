"""Images per second of the model step alone, of each data pipeline alone, and of sslkit's full step per pipeline.

    python benchmarks/throughput.py [--device cuda|cpu] [--quick] [--presets simclr_rn50,multicrop,rn18_32,...]
                                    [--steps 20] [--warmup 5] [--compile] [--tools] [key=value ...]
    python benchmarks/throughput.py --strategy ddp,fsdp [--nproc N] [--presets dinov2_vit_s16,...] [...]

In one process, for each preset:

(a) **raw**: the plain PyTorch step (forward, loss, backward, optimizer step, the method's own hooks such
    as the EMA teacher) on synthetic views already on the device, of the shapes the preset trains on:
    what the model can take;
(b) **loader**, per pipeline: the batches alone, with nothing trained, ready on the device as the model
    takes them (for ``device`` pipelines the decode and augmentation on the device are included, the
    device synchronised at the end);
(c) **step**, per pipeline: sslkit's trainer and standard step (prefetch, guard, hooks, logging);

and prints c / a: how much of what the model can take the pipeline delivers (1.0: the data costs
nothing). The presets are

* ``simclr_rn50``: SimCLR, ResNet-50, two 224 px views, from a folder of JPEGs the benchmark writes
  itself (photo-like content, ImageNet's sizes around 500 x 375, portrait and landscape);
* ``multicrop``: DINO, ResNet-50, 2 x 224 + 6 x 96 px crops, the same JPEG folder;
* ``rn18_32``: SimCLR, ResNet-18 with the small-image stem, two 32 px views of the in-memory synthetic
  source (no decoding);
* ``mae_vit_s16``: MAE, ViT-S/16 (fixed sine-cosine positions), one 224 px view with 75% of its 196 patches
  dropped, the paper's decoder (512-d, 8 blocks, 16 heads), the JPEG folder;
* ``dino_vit_s16``: DINO, ViT-S/16 (drop path 0.1), 2 x 224 + 6 x 96 px crops, the paper's head (65536
  prototypes), the JPEG folder;
* ``dinov2_vit_s16``, ``ijepa_vit_s16``: the paper-scale recipes as they are;
* ``dinov3_vit_l16``: ``config=dinov3_vitl16`` (timm's RoPE ViT-L/16 with 4 registers, two 65536-prototype heads)
  at 2 x 256 + 8 x 112 px crops, batch 64 per process (centring for Sinkhorn-Knopp: one solve needs 256 rows), with
  its Gram stage's extra forward from the first update;
  DINOv3's own record for ViT-L/16 is about 159 img/s per H100 (docs/results.md says how that is derived);
* ``distill_vitl16``: ``config=distill_vitl16``, a DINOv3 ViT-L/16 teacher (fresh weights, written once into the
  scratch folder) into a ViT-S/16 and a ResNet-50, 224 px, batch 128; a second table gives the teacher's forward
  alone and its share of the plain step.

For the ViT presets the table names the attention kernel PyTorch's ``scaled_dot_product_attention`` runs
(timm's attention calls it): the aten operator seen in a profiled step, e.g. ``flash`` (FlashAttention-2),
``efficient`` (memory-efficient), ``cudnn``, ``math``, or ``flash_cpu`` on the CPU.

Pipelines: ``workers`` (``data.augment_on=workers``: decode and augment in the loader workers),
``device`` (``augment_on=device``: the workers decode, the batch is augmented on the device) and, for
JPEG folders, ``device+decode`` (``decode_on=device`` as well: the workers only read bytes; nvJPEG
on CUDA). On CUDA the precision is bf16 autocast with channels_last, on the CPU fp32. ``--quick``
shrinks everything (64 px crops, 32 px small crops, batch 16, 4 steps) so that ``--device cpu --quick``
ends in a few minutes on 2 cores and prints the same table. ``--tools`` adds the augmentation alone,
batched ops against kornia's (where kornia is installed), on one batch already on the device.
Overrides (``data.batch_size=128``, ``data.num_workers=8``) apply to every run.

``--strategy ddp,fsdp`` times the model step on ``--nproc`` processes (default: every GPU, 2 on the CPU) under
each ``distributed.strategy``, on synthetic views of the preset's shapes (the data pipelines are the single-process
table's business): (a) the plain PyTorch step (forward, loss, backward, optimizer step, the method's hooks) on the
model as sslkit builds it under that strategy (DDP-wrapped, or ``fully_shard`` per block, then the modules that
own blocks, then the root), and (c) sslkit's full step on it, both as global images/s over all processes, with
c / a and each process's peak GPU memory. A preset the config check refuses under a strategy (a CNN under
``fsdp``) gets a row saying why.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sslkit.launch.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # same allocator settings as tools/run.py, before torch is imported

import torch  # noqa: E402

from sslkit.builder import build_task  # noqa: E402
from sslkit.config.schema import ConfigError  # noqa: E402
from sslkit.console import setup_logging  # noqa: E402
from sslkit.hooks.base import Event  # noqa: E402
from sslkit.task import MicroBatch, SSLTask  # noqa: E402
from sslkit.train_steps.stages import model_keywords, precision, prepare_sample, split_loss  # noqa: E402
from sslkit.train_steps.standard import standard_train_step  # noqa: E402
from sslkit.trainer import train  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Clock, StepClock, _dispatcher, bench_config, machine_header, method_hooks  # noqa: E402

PIPELINES = {
    "workers": ["data.augment_on=workers"],
    "device": ["data.augment_on=device", "data.decode_on=workers"],
    "device+decode": ["data.augment_on=device", "data.decode_on=device"],
}


@dataclass
class Preset:
    """One model and data setting."""

    recipe: str
    trunk: list[str]
    jpeg: bool  # a JPEG folder (else the in-memory synthetic source)
    image_size: int
    small_size: int = 0
    num_small: int = 0
    batch: int = 256
    num_large: int = 2
    #: a distillation preset's teacher: this sslkit trunk with fresh weights, written once as a weights file
    teacher: str | None = None

    def views(self) -> list[int]:
        """The side of every view the model takes."""
        return [self.image_size] * self.num_large + [self.small_size] * self.num_small

    def describe(self) -> str:
        """``2x224 + 6x96``."""
        small = f" + {self.num_small}x{self.small_size}" if self.num_small else ""
        return f"{self.num_large}x{self.image_size}{small}"


PRESETS = {
    "simclr_rn50": Preset("simclr", ["model.trunk=resnet50"], jpeg=True, image_size=224),
    "multicrop": Preset("dino", ["model.trunk=resnet50"], jpeg=True, image_size=224, small_size=96, num_small=6,
                        batch=128),
    "rn18_32": Preset("simclr", ["model.trunk=resnet18", "model.trunk_kwargs.small_image_stem=true"], jpeg=False,
                      image_size=32, batch=512),
    "mae_vit_s16": Preset("mae", ["model.trunk=vit_small", "model.trunk_kwargs={patch_size: 16, pos_embed: sincos}",
                                  "model.kwargs.decoder_dim=512", "model.kwargs.decoder_depth=8",
                                  "model.kwargs.decoder_heads=16"], jpeg=True, image_size=224, batch=256, num_large=1),
    "dino_vit_s16": Preset("dino_vit", ["model.trunk=vit_small",
                                        "model.trunk_kwargs={patch_size: 16, drop_path_rate: 0.1}",
                                        "model.head.out_dim=65536", "model.head.hidden_dim=2048",
                                        "model.head.bottleneck_dim=256"], jpeg=True, image_size=224, small_size=96,
                           num_small=6, batch=64),
    # the paper-scale recipes as they are (ViT-S/16, 224 px): DINOv2's 2 + 8 crops, 65536 prototypes, Sinkhorn-Knopp
    # (batch 128: 256 teacher rows, the fewest it takes for 65536 prototypes); I-JEPA's one view, 4 target blocks
    "dinov2_vit_s16": Preset("dinov2_vits16", [], jpeg=True, image_size=224, small_size=96, num_small=8, batch=128),
    "ijepa_vit_s16": Preset("ijepa_vits16", [], jpeg=True, image_size=224, batch=128, num_large=1),
    # DINOv3's ViT-L/16 (timm's RoPE trunk, 4 registers, two 65536-prototype heads) at the issue's 2 x 256 + 8 x 112
    # crops, batch 64 per GPU as facebookresearch/dinov3's vitl_im1k_lin834.yaml; the Gram loss on from the first
    # update (its Gram teacher's forward: the recipe's heaviest step, that of its last sixth)
    # (one process of DINOv3's 64 per GPU: too few teacher rows for one Sinkhorn-Knopp solve over 65536 prototypes,
    # which the config check refuses; centring, a few ops on [128, 65536] either way, keeps the step's work)
    "dinov3_vit_l16": Preset("dinov3_vitl16", ["gram.start_step=0", "loss.centering=centering"], jpeg=True,
                             image_size=256, small_size=112,
                             num_small=8, batch=64),
    # config=distill_vitl16: a DINOv3 ViT-L/16 teacher (fresh weights: the speed is the architecture's) into a
    # ViT-S/16 and a ResNet-50 on the same batches, one 224 px view, the feature objective's dense term; the table
    # after the main one gives the teacher's share of the step
    "distill_vitl16": Preset("distill_vitl16", [], jpeg=True, image_size=224, batch=128, num_large=1,
                             teacher="vit_large_patch16_dinov3"),
}


def _quick(preset: Preset) -> Preset:
    """The preset at CPU size: 64 px crops (32 px small ones, 2 of them), batch 16 (Sinkhorn-Knopp's 32 teacher rows
    cannot spread over 65536 prototypes: centring instead; I-JEPA's blocks need more than 4 x 4 patches: 8 px)."""
    trunk = list(preset.trunk)
    if preset.recipe.startswith(("dinov2", "dinov3")):
        trunk.append("loss.centering=centering")
    if preset.recipe.startswith("ijepa"):
        trunk.append("model.trunk_kwargs.patch_size=8")
    return Preset(preset.recipe, trunk, preset.jpeg, 64 if preset.jpeg else 32,
                  32 if preset.num_small else 0, 2 if preset.num_small else 0, 16, preset.num_large,
                  "vit_small_patch16_dinov3" if preset.teacher else None)


def teacher_overrides(preset: Preset) -> list[str]:
    """A distillation preset's teacher: its trunk with fresh weights (seed 0), written once into the temporary
    folder (a ViT-L/16: 1.2 GB) and found there by later runs and processes."""
    if preset.teacher is None:
        return []
    from safetensors.torch import save_file

    from sslkit import registry as R

    file = Path(tempfile.gettempdir()) / f"sslkit-bench-teacher-{preset.teacher}-{preset.image_size}.safetensors"
    if not file.exists():
        torch.manual_seed(0)
        trunk = R.get(R.TRUNKS, preset.teacher)(in_channels=3, img_size=preset.image_size, patch_size=16)
        partial = file.with_suffix(f".{os.getpid()}.part")
        save_file({k: v.contiguous() for k, v in trunk.state_dict().items()}, str(partial))
        os.replace(partial, file)
    return [f"distill.teacher={file}", f"distill.teacher_trunk={preset.teacher}"]


def teacher_rate(task: SSLTask, preset: Preset, steps: int, warmup: int) -> float:
    """A distillation's teacher alone: images/s of its forward (no gradient, the step's precision) on the preset's
    views, as the step computes it once for all students."""
    teacher = task.base_model.teacher
    views = [torch.randn(preset.batch, 3, s, s, device=task.device).contiguous(memory_format=torch.channels_last)
             for s in preset.views()]
    dense = any(s.patch_proj is not None for s in task.base_model.students.values())
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(task.device)
            start = time.perf_counter()
        with precision(task):
            teacher.encode(views, dense)
    _sync(task.device)
    return preset.batch * steps / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------------- data
def _write_jpegs(args: tuple[str, int, int, float]) -> None:
    """Write JPEGs ``first..last`` of a folder: smooth colour fields with texture, at photo-like sizes."""
    import numpy as np
    from PIL import Image

    root, first, last, scale = args
    for i in range(first, last):
        rng = np.random.default_rng(i)
        w, h = (500, 375) if i % 3 else (375, 500)
        if i % 7 == 0:
            w, h = 500, 333
        w, h = max(8, int(w * scale)), max(8, int(h * scale))
        coarse = rng.random((6, 8, 3))
        field = np.asarray(Image.fromarray((coarse * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC), np.float32)
        texture = rng.normal(0, 12, (h, w, 3)).astype(np.float32)
        pixels = np.clip(field + texture, 0, 255).astype(np.uint8)
        folder = Path(root) / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=90)


def make_jpeg_folder(root: Path, count: int, scale: float) -> Path:
    """``count`` JPEGs in 10 class folders under ``root`` (written by all cores)."""
    cores = os.cpu_count() or 1
    per = math.ceil(count / cores)
    jobs = [(str(root), a, min(count, a + per), scale) for a in range(0, count, per)]
    with ProcessPoolExecutor(max_workers=cores) as pool:
        list(pool.map(_write_jpegs, jobs))
    return root


def preset_overrides(preset: Preset, data: Path | None, samples: int, device: str) -> list[str]:
    """The config of a preset: recipe, trunk, views, data, precision."""
    if preset.jpeg:
        source = ["data=folder", f"data.train.path={data}"]
    else:
        source = ["data=synthetic", f"data.train.kwargs.num_samples={samples}",
                  f"data.train.kwargs.image_size={preset.image_size}",
                  f"data.test.kwargs.image_size={preset.image_size}"]
    crops = [f"data.image_size={preset.image_size}"]
    if preset.num_small:
        crops += [f"data.small_image_size={preset.small_size}", f"data.transform.num_small={preset.num_small}"]
    amp = ["amp.enabled=true", "amp.dtype=bfloat16"] if device == "cuda" else ["amp.enabled=false"]
    return [f"config={preset.recipe}", *source, *preset.trunk, *crops, f"data.batch_size={preset.batch}",
            f"machine.device={device}", "machine.channels_last=true", *amp, "log.every_n_steps=1000",
            *teacher_overrides(preset)]


# ------------------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_rate(task: SSLTask, preset: Preset, steps: int, warmup: int) -> float:
    """(a) images/s of the plain step on synthetic views already on the device."""
    device, b = task.device, preset.batch
    channels = 3
    views = [torch.randn(b, channels, s, s, device=device).contiguous(memory_format=torch.channels_last)
             for s in preset.views()]
    sample = {"input": views, "target": torch.zeros(b, dtype=torch.int64, device=device),
              "data_valid": torch.ones(b, dtype=torch.bool, device=device),
              "data_idx": torch.arange(b, device=device)}
    if task.masking is not None:  # a masked method: its masks, drawn as the sample stage draws them
        sample["masks"] = task.masking(views, sample["data_idx"], 0)
    fire = _dispatcher(method_hooks(task), task)
    model, opt = task.model, task.optimizer
    fire(Event.ON_START)
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        task.last_batch = MicroBatch(sample=sample)
        with precision(task):
            out = model(views, **model_keywords(sample))
            task.last_batch.model_output = out
            fire(Event.ON_FORWARD)
            loss, _ = split_loss(task.loss(out, sample, task.context()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        fire(Event.ON_BACKWARD)
        opt.step()
        fire(Event.ON_UPDATE)
        task.clock.step += 1
    _sync(device)
    return b * steps / (time.perf_counter() - start)


#: aten operators of torch.nn.functional.scaled_dot_product_attention's kernels -> the name the table prints.
ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
}


def attention_kernels(task: SSLTask, preset: Preset) -> str:
    """The attention kernels one forward and backward of the preset's model runs (a profiled step on synthetic
    views), or ``-`` for a model without attention."""
    from torch.profiler import ProfilerActivity, profile

    b = min(preset.batch, 8)
    views = [torch.randn(b, 3, s, s, device=task.device) for s in preset.views()]
    masks = task.masking(views, torch.arange(b, device=task.device), 0) if task.masking else None
    sample = {"input": views, "data_idx": torch.arange(b), "masks": masks}
    with profile(activities=[ProfilerActivity.CPU]) as prof, precision(task):
        out = task.model(views, **model_keywords(sample))
        loss, _ = split_loss(task.loss(out, sample, task.context()))
        loss.backward()
    task.optimizer.zero_grad(set_to_none=True)
    seen = {ATTENTION_OPS[e.key] for e in prof.key_averages() if e.key in ATTENTION_OPS}
    return ", ".join(sorted(seen)) or "-"


def loader_rate(task: SSLTask, steps: int, warmup: int) -> float:
    """(b) images/s of the train batches alone, made ready on the device as the model takes them."""
    loader, device = task.loaders["train"], task.device
    batches = iter(loader)
    images, start = 0, 0.0
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        sample = prepare_sample(task, next(batches))
        if i >= warmup:
            images += len(sample["data_idx"])
    _sync(device)
    return images / (time.perf_counter() - start)


def step_rate(cfg_overrides: list[str], out: str, steps: int, warmup: int) -> tuple[float, SSLTask]:
    """(c) images/s of sslkit's full step (trainer, standard step, hooks)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    task = build_task(bench_config(warmup + steps, cfg_overrides, out))
    clock = Clock(task.device, warmup, task.clock.max_steps)
    task.hooks.append(StepClock(clock))
    train(task, standard_train_step)
    return task.global_batch_size * steps / clock.block_seconds(), task


def tool_rates(preset: Preset, device: torch.device, steps: int) -> list[tuple[str, float | str]]:
    """The augmentation alone on one uint8 batch on the device: sslkit's batched ops (eager, compiled), kornia's
    (eager; its ColorJitter draws one order of the four adjustments per batch, ours one per sample)."""
    from sslkit.data.device_augment import device_augment_for
    from sslkit.data.transforms import build_simclr

    size = 375 if preset.image_size >= 128 else preset.image_size * 2
    images = torch.randint(0, 256, (preset.batch, 3, size, size), dtype=torch.uint8, device=device)
    transform = build_simclr(preset.image_size, crop_scale=(0.08, 1.0), blur_p=0.5)
    ours = device_augment_for(transform)
    generator = torch.Generator(device=device).manual_seed(0)

    def timed(fn) -> float:
        fn()
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        return preset.batch * steps / (time.perf_counter() - t)

    rows: list[tuple[str, float | str]] = [("sslkit batched ops (2 views)", timed(lambda: ours(images, generator)))]
    compiled = device_augment_for(transform)
    compiled.compile()  # inductor; the first call compiles and is left out of the timing
    rows.append(("sslkit batched ops, torch.compile (2 views)", timed(lambda: compiled(images, generator))))
    try:
        import kornia.augmentation as K
    except ImportError:
        rows.append(("kornia (2 views)", "not installed (pip install kornia)"))
        return rows
    s = preset.image_size
    pipeline = torch.nn.Sequential(
        K.RandomResizedCrop((s, s), scale=(0.08, 1.0)), K.RandomHorizontalFlip(),
        K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8), K.RandomGrayscale(p=0.2),
        K.RandomGaussianBlur((s // 10 * 2 + 1, s // 10 * 2 + 1), (0.1, 2.0), p=0.5),
        K.Normalize(mean=torch.tensor([0.485, 0.456, 0.406]), std=torch.tensor([0.229, 0.224, 0.225])),
    ).to(device)
    rows.append(("kornia (2 views)", timed(lambda: [pipeline(images.float() / 255) for _ in range(2)])))
    return rows


# ------------------------------------------------------------------------------------------- strategies
def _refusal(exc: ConfigError) -> str:
    """The first reason of a config refusal, on one line (a table cell)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[1] if len(lines) > 1 else lines[0]).replace("|", "/")[:160]


def strategy_worker(names: list[str], quick: bool, strategies: list[str], steps: int, warmup: int, device: str,
                    extra: list[str], scratch: str, out: str) -> None:
    """One process of ``--strategy`` (its process group is up): (a) and (c) for each preset and strategy; rank 0
    prints the machine and writes the rows to ``out``."""
    import dataclasses
    import json

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows, header = [], False
    for name in names:
        preset = dataclasses.replace(_quick(PRESETS[name]) if quick else PRESETS[name], jpeg=False)
        for strategy in strategies:
            samples = preset.batch * world * (warmup + steps + 2)
            base = [*preset_overrides(preset, None, samples, device), f"distributed.strategy={strategy}", *extra]
            folder = os.path.join(scratch, f"{name}-{strategy}")
            try:
                cfg = bench_config(warmup + steps, base, os.path.join(folder, "raw"))
            except ConfigError as exc:  # the config check's own refusal (a CNN under fsdp): its row says it
                rows.append({"preset": name, "strategy": strategy, "note": f"refused: {_refusal(exc)}"})
                continue
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            raw_task = build_task(cfg)
            if not header and rank == 0:
                print("\n".join(machine_header(raw_task.config, raw_task.device)), flush=True)
                header = True
            raw = raw_rate(raw_task, preset, steps, warmup) * world  # each process's batch: global images/s
            raw_task.close()
            del raw_task
            full, task = step_rate(base, os.path.join(folder, "step"), steps, warmup)
            task.close()
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            peaks = [None] * world
            dist.all_gather_object(peaks, peak)
            rows.append({"preset": name, "strategy": strategy, "views": preset.describe(), "batch": preset.batch,
                         "raw": raw, "full": full, "peak_gib": peaks})
            if rank == 0:
                print(f"{name} {strategy}: raw step {raw:,.0f} img/s, full step {full:,.0f} img/s", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def measure_strategies(args: argparse.Namespace, names: list[str], steps: int, warmup: int, overrides: list[str],
                       scratch: Path) -> int:
    """``--strategy``: start the processes, then print their table."""
    import json

    from sslkit.distributed import launch

    strategies = [s for s in args.strategy.split(",") if s]
    if bad := [s for s in strategies if s not in ("ddp", "fsdp")]:
        print(f"throughput.py: --strategy {','.join(bad)}: choose ddp, fsdp or both (ddp,fsdp)", file=sys.stderr)
        return 2
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if nproc < 2:
        print(f"throughput.py: --strategy needs 2 processes or more, and --nproc / the GPUs here give {nproc}: on one "
              "GPU there is nothing to shard (run without --strategy)", file=sys.stderr)
        return 2
    extra = [*(["machine.compile=true"] if args.compile else []), *overrides]
    out = scratch / "rows.json"
    launch(strategy_worker, (names, args.quick, strategies, steps, warmup, args.device, extra, str(scratch),
                             str(out)), nproc_per_node=nproc, device=args.device)
    rows = json.loads(out.read_text())
    print()
    print(f"{nproc} processes; images/s over all of them; peak GPU memory per process")
    print("| preset | strategy | views | batch per process | (c) step img/s | (a) raw img/s | c / a | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "note" in r:
            print(f"| {r['preset']} | {r['strategy']} | {r['note']} | | | | | |")
            continue
        peak = "-" if r["peak_gib"][0] is None else " / ".join(f"{g:.2f}" for g in r["peak_gib"])
        print(f"| {r['preset']} | {r['strategy']} | {r['views']} | {r['batch']} | {r['full']:,.0f} | "
              f"{r['raw']:,.0f} | {r['full'] / r['raw']:.2f} | {peak} |")
    return 0


# ------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the table; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small settings (CPU: a few minutes on 2 cores)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 4)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out first (default 5, quick 1)")
    parser.add_argument("--compile", action="store_true", help="machine.compile=true for (a) and (c)")
    parser.add_argument("--tools", action="store_true", help="also time the augmentation alone: ours vs kornia")
    parser.add_argument("--strategy", default="", help="ddp, fsdp or ddp,fsdp: the model step on --nproc processes")
    parser.add_argument("--nproc", type=int, default=0, help="processes for --strategy (default: the GPUs, 2 on CPU)")
    args, overrides = parser.parse_known_args(argv)
    if bad := [o for o in overrides if "=" not in o]:
        parser.error(f"not an option nor a key=value override: {' '.join(bad)}")
    names = [n for n in args.presets.split(",") if n]
    if unknown := [n for n in names if n not in PRESETS]:
        parser.error(f"unknown preset(s) {unknown}: choose from {', '.join(PRESETS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("throughput.py: --device cuda, but no CUDA device is visible here; use --device cpu --quick",
              file=sys.stderr)
        return 2
    steps = args.steps or (4 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    setup_logging(None)
    import logging

    logging.getLogger("sslkit").setLevel(logging.WARNING)
    scratch = Path(tempfile.mkdtemp(prefix="sslkit_throughput_"))
    try:
        if args.strategy:
            return measure_strategies(args, names, steps, warmup, overrides, scratch)
        return _measure(args, names, steps, warmup, overrides, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(args: argparse.Namespace, names: list[str], steps: int, warmup: int, overrides: list[str],
             scratch: Path) -> int:
    presets = {n: _quick(PRESETS[n]) if args.quick else PRESETS[n] for n in names}
    extra = [*(["machine.compile=true"] if args.compile else []), *overrides]
    largest = max(p.batch for p in presets.values())
    samples = largest * (warmup + steps + 2)
    folder = None
    if any(p.jpeg for p in presets.values()):
        t = time.perf_counter()
        folder = make_jpeg_folder(scratch / "jpeg", samples, 0.32 if args.quick else 1.0)
        print(f"wrote {samples} JPEGs to {folder} in {time.perf_counter() - t:.0f} s", flush=True)
    rows = []
    teachers: list[tuple[str, str, float, float]] = []
    header_done = False
    for name, preset in presets.items():
        base = [*preset_overrides(preset, folder, samples, args.device), *extra]
        raw_task = build_task(bench_config(warmup + steps, base, str(scratch / "raw")))
        t0 = time.perf_counter()
        if not header_done:
            print("\n".join(machine_header(raw_task.config, raw_task.device)), flush=True)
            header_done = True
        attention = attention_kernels(raw_task, preset)
        trunk = str(raw_task.config.model.trunk)
        raw = raw_rate(raw_task, preset, steps, warmup)
        if preset.teacher:
            teachers.append((name, str(raw_task.config.distill.teacher_trunk), teacher_rate(raw_task, preset, steps,
                                                                                             warmup), raw))
        del raw_task
        print(f"{name}: raw step {raw:,.0f} img/s; attention kernel(s): {attention}", flush=True)
        pipelines = [p for p in PIPELINES if preset.jpeg or p != "device+decode"]
        for pipeline in pipelines:
            cfg = [*base, *PIPELINES[pipeline]]
            loader_task = build_task(bench_config(warmup + steps, cfg, str(scratch / "loader")))
            workers = loader_task.loaders["train"].num_workers
            loaded = loader_rate(loader_task, steps, warmup)
            loader_task.close()
            del loader_task
            full, task = step_rate(cfg, str(scratch / f"{name}-{pipeline}"), steps, warmup)
            task.close()
            print(f"{name} {pipeline}: loader {loaded:,.0f} img/s, full step {full:,.0f} img/s "
                  f"({time.perf_counter() - t0:.0f} s so far)", flush=True)
            rows.append((name, preset, trunk, pipeline, workers, loaded, full, raw, attention))
    print()
    print("| preset | trunk | views | batch | pipeline | workers | (b) loader img/s | (c) step img/s | "
          "(a) raw img/s | c / a | attention |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, preset, trunk, pipeline, workers, loaded, full, raw, attention in rows:
        print(f"| {name} | {trunk} | {preset.describe()} | {preset.batch} | {pipeline} | {workers} | "
              f"{loaded:,.0f} | {full:,.0f} | {raw:,.0f} | {full / raw:.2f} | {attention} |")
    if teachers:
        print()
        print("| preset | teacher | teacher forward img/s | (a) raw step img/s | teacher's share of the step |")
        print("| --- | --- | --- | --- | --- |")
        for name, trunk, alone, raw in teachers:
            print(f"| {name} | {trunk} | {alone:,.0f} | {raw:,.0f} | {raw / alone:.0%} |")
    if args.tools:
        print()
        print("| augmentation alone, one batch on the device | images/s |")
        print("| --- | --- |")
        first = next(iter(presets.values()))
        for label, rate in tool_rates(first, torch.device(args.device), steps):
            print(f"| {label} | {rate if isinstance(rate, str) else f'{rate:,.0f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
