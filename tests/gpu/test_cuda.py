"""On CUDA: every recipe (bf16 autocast, channels_last), resume, kNN, no sync in the step, deterministic runs.

Marked ``gpu``: skipped where no CUDA device is visible (CI). Run them on a GPU machine with
``python -m pytest -q -m gpu``. The CPU checks of the same properties are tests/launch/test_audit.py
(device-less tensors, host syncs, nondeterministic ops, unregistered state) and
tests/reliability/test_resume.py (bit-exact resume on the CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, metrics, run_cli
from reliability_helpers import BASE, FAULT_ENV, RECIPE_ARGS, assert_identical, hooks_override, latest_state

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: What a GPU user runs: bf16 autocast and channels_last on the GPU (later overrides win over SMALL's cpu).
GPU = ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16", "machine.channels_last=true"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_and_evaluates_on_cuda(tmp_path: Path, recipe: str) -> None:
    out = tmp_path / recipe
    proc = run_cli(f"config={recipe}", *SMALL, *RECIPES[recipe], *GPU, "optim.max_steps=3", f"output_dir={out}")
    assert "device cuda:" in proc.stdout and "AMP torch.bfloat16" in proc.stdout
    train = [r for r in metrics(out) if r.get("phase") == "train"]
    assert train and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert any("knn_top1" in r for r in metrics(out))  # the kNN evaluation ran on the GPU
    assert "GPU time per section (CUDA events)" in (out / "log.txt").read_text()


@pytest.mark.parametrize("recipe", ["simclr", "dino", "distill"])
def test_resume_on_cuda_restores_the_state_onto_the_gpu(tmp_path: Path, recipe: str) -> None:
    """A run killed after step 10 resumes from step 8 on the GPU (the RNG states must come back as CPU tensors,
    the model, loss buffers and optimizer state on the GPU) and finishes."""
    from sslkit.builder import build_task
    from sslkit.checkpoint import Checkpointer
    from sslkit.config.compose import compose_config

    args = [f"config={recipe}", *BASE, *RECIPE_ARGS[recipe], *GPU, "optim.epochs=2", "checkpoint.every_n_steps=4"]
    out = tmp_path / "run"
    kill = hooks_override(recipe, {"name": "fault_signal", "step": 10, "signal": "SIGKILL"})
    assert run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV, check=False).returncode != 0
    resumed = run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV)
    assert "checkpoint_000000008.pt" in resumed.stdout and latest_state(out)["position"]["step"] == 12

    task = build_task(compose_config([*args, f"output_dir={tmp_path / 'fresh'}"]))
    state, path = Checkpointer(str(out)).read_latest()
    # a checkpoint written on CUDA (CUDA RNG states included) holds only what weights_only=True loads
    assert torch.load(path, map_location="cpu", weights_only=True)["rng"][0]["cuda"]
    Checkpointer.restore(task, state)
    assert {p.device.type for p in task.base_model.parameters()} == {"cuda"}
    assert {b.device.type for b in task.loss.buffers()} <= {"cuda"}
    moments = [v for s in task.optimizer.state.values() for k, v in s.items()
               if isinstance(v, torch.Tensor) and k != "step"]
    assert moments and {v.device.type for v in moments} == {"cuda"}


@pytest.mark.parametrize("recipe", ["simclr", "moco", "swav", "dino"])
def test_deterministic_cuda_runs_and_resumes_are_bit_identical(tmp_path: Path, recipe: str) -> None:
    """machine.deterministic=true: two identical runs, and a run killed with SIGKILL mid-epoch and resumed, end
    with identical checkpoints (model, teacher, optimizer, queues, centre, hook states, RNG of CPU and GPU)."""
    args = [f"config={recipe}", *BASE, *RECIPE_ARGS[recipe], *GPU, "machine.deterministic=true", "optim.epochs=2",
            "checkpoint.every_n_steps=4"]
    never = hooks_override(recipe, {"name": "fault_signal", "step": 10**6})
    kill = hooks_override(recipe, {"name": "fault_signal", "step": 10, "signal": "SIGKILL"})
    run_cli(*args, never, f"output_dir={tmp_path / 'a'}", env=FAULT_ENV)
    run_cli(*args, never, f"output_dir={tmp_path / 'b'}", env=FAULT_ENV)
    reference = latest_state(tmp_path / "a")
    assert "cuda" in reference["rng"][0]
    assert_identical(latest_state(tmp_path / "b"), reference)

    out = tmp_path / "killed"
    assert run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV, check=False).returncode != 0
    run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV)
    assert_identical(latest_state(out), reference)


@pytest.mark.parametrize("recipe", ["simclr", "moco", "byol", "swav", "dino", "vicreg", "ibot", "dinov2", "dinov3",
                                    "ijepa"])
def test_no_host_device_sync_inside_the_step(tmp_path: Path, recipe: str) -> None:
    """CUDA's sync debug mode raises on any synchronising call (item, a blocking copy, a stream sync) inside steps
    3-6; the first two may sync (cuDNN autotuning, first allocations). Logging and checkpoints, which sync at their
    interval by contract, run outside the step."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], *GPU, "optim.max_steps=6",
                          "log.every_n_steps=100", "eval.knn.enabled=false", "log.tensorboard=false",
                          f"output_dir={tmp_path}"])
    task = build_task(cfg)
    steps = {"done": 0}

    def watched(task) -> None:
        steps["done"] += 1
        if steps["done"] <= 2:
            return standard_train_step(task)
        torch.cuda.set_sync_debug_mode("error")
        try:
            standard_train_step(task)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    train(task, watched)
    assert task.clock.step == 6


def test_step_timers_charge_gpu_time_to_the_section_that_queued_it() -> None:
    """Host timers would give ~0 to 'kernel' (it only queues) and the whole time to 'wait' (it syncs)."""
    from sslkit.train_steps.timing import PerfStats

    stats = PerfStats(torch.device("cuda"))
    torch.cuda.synchronize()
    with stats.timer("kernel"):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time, returns at once on the host
    with stats.timer("wait"):
        torch.cuda.synchronize()
    stats.resolve()
    assert stats.totals["kernel"] > 0.005
    assert stats.totals["kernel"] > 10 * stats.totals["wait"]
    assert "GPU time per section" in stats.table()


def test_more_processes_than_gpus_stop_at_config_time(tmp_path: Path) -> None:
    out = tmp_path / "run"
    n = torch.cuda.device_count() + 1
    proc = run_cli("config=simclr", *SMALL, "machine.device=cuda", f"distributed.nproc_per_node={n}",
                   f"output_dir={out}", check=False)
    assert proc.returncode == 2
    assert f"Set distributed.nproc_per_node={n - 1}, or machine.device=cpu" in proc.stderr
    assert not out.exists()


def test_auto_workers_and_pinned_memory_on_cuda(tmp_path: Path) -> None:
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config

    task = build_task(compose_config(["config=simclr", *SMALL, *GPU, "data.num_workers=auto", "data.pin_memory=auto",
                                      f"output_dir={tmp_path}"]))
    loader = task.loaders["train"]
    assert loader.pin_memory and loader.num_workers >= 1 and loader.persistent_workers
    assert torch.backends.cudnn.benchmark  # autotuned convolutions when not deterministic


def test_device_augmentation_on_cuda_equals_the_cpu_one() -> None:
    """The batched augmentation on CUDA gives the CPU's pixels for the same uniforms (every operation; the
    crop's roi_align too, up to float rounding), and multi-crop views come back on the GPU."""
    from sslkit.data.device_augment import UNIFORMS_PER_VIEW, DeviceSimCLRAugment, device_augment_for
    from sslkit.data.transforms import build_multicrop

    images = torch.randint(0, 256, (64, 3, 40, 40), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    u = torch.rand(64, UNIFORMS_PER_VIEW, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    augment = DeviceSimCLRAugment(image_size=32, jitter_strength=0.5, grayscale_p=0.3, blur_p=0.5, solarize_p=0.4)
    cpu = augment.views(images, u)
    cuda = augment.views(images.cuda(), u.cuda())
    assert cuda.is_cuda and (cuda.cpu() - cpu).abs().max().item() < 1e-3
    views = device_augment_for(build_multicrop(32, 16, num_small=2))(images.cuda(),
                                                                      torch.Generator(device="cuda").manual_seed(2))
    assert [tuple(v.shape) for v in views] == [(64, 3, 32, 32)] * 2 + [(64, 3, 16, 16)] * 2
    assert all(v.is_cuda and torch.isfinite(v).all() for v in views)


@pytest.mark.parametrize("recipe", ["simclr", "dino"])
def test_recipe_trains_with_the_batch_augmented_on_cuda(tmp_path: Path, recipe: str) -> None:
    out = tmp_path / recipe
    proc = run_cli(f"config={recipe}", *SMALL, *RECIPES[recipe], *GPU, "data.augment_on=device", "optim.max_steps=3",
                   "eval.knn.enabled=false", f"output_dir={out}")
    assert "augmented on the training device" in proc.stdout
    train = [r for r in metrics(out) if r.get("phase") == "train"]
    assert train and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)


def test_accumulation_schedules_on_cuda(tmp_path: Path) -> None:
    """DINO on the GPU with 2 micro-batches of 8 against batches of 16: every schedule has the same value at
    every logged update (the clock, and the centre's one all-reduce per update, on CUDA)."""
    keys = ("lr", "weight_decay", "teacher_momentum", "teacher_temp")
    runs = []
    for name, extra in (("whole", ["data.batch_size=16"]), ("acc", ["data.batch_size=8", "optim.micro_batches=2"])):
        out = tmp_path / name
        run_cli("config=dino", *SMALL, *RECIPES["dino"], *GPU, *extra, "optim.epochs=2", "log.every_n_steps=1",
                "eval.knn.enabled=false", "loss.warmup_teacher_temp_steps=5", f"output_dir={out}")
        records = [r for r in metrics(out) if r.get("phase") == "train" and "teacher_temp" in r]
        runs.append([{k: r[k] for k in keys} for r in records])
    assert len(runs[0]) == 8 and runs[0] == runs[1]


def test_prefetcher_on_cuda_gives_the_batches_prepared_in_line() -> None:
    """The side stream's preparation (pinned copy, arithmetic) of batch k+1 while the default stream is busy gives
    exactly what preparing in line gives, and the default stream waits for it before reading."""
    from sslkit.data.prefetch import Prefetcher

    batches = [torch.randn(256, 3, 64, 64).pin_memory() for _ in range(6)]

    def prepare(batch: torch.Tensor) -> dict:
        x = batch.to("cuda", non_blocking=True)
        return {"input": [x.mul(2).add_(1.0).sin_()]}

    expected = [prepare(b)["input"][0].cpu() for b in batches]
    busy = torch.randn(4096, 4096, device="cuda")
    got = []
    for sample in Prefetcher(iter(batches), prepare, torch.device("cuda")):
        for _ in range(5):  # keep the default stream busy while the next batch is prepared beside it
            busy = busy @ busy / 4096
        got.append(sample["input"][0].cpu())
    assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_folder_of_photos_is_decoded_and_augmented_on_cuda_by_default(tmp_path: Path) -> None:
    """On CUDA, data.augment_on=auto and data.decode_on=auto put both on the GPU: JPEGs of many sizes are
    decoded by nvJPEG in one call per batch, PNGs in the workers, the corrupt JPEG is skipped and counted."""
    from helpers import photo_folder

    photo_folder(tmp_path / "images")
    out = tmp_path / "run"
    proc = run_cli("config=simclr", "data=folder", f"data.train.path={tmp_path / 'images'}", *GPU,
                   "model.trunk=small_cnn", "model.trunk_kwargs={width: 8}", "data.image_size=16",
                   "data.small_image_size=8", "data.batch_size=8", "optim.max_steps=3", "eval.knn.enabled=false",
                   "log.every_n_steps=1", "data.num_workers=2", f"output_dir={out}")
    assert "augmented on the training device" in proc.stdout and "decoded on the training device" in proc.stdout
    records = metrics(out)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if r.get("phase") == "train" and "loss" in r)
    assert sum(r.get("unreadable_samples", 0) for r in records) == 1


@pytest.mark.parametrize("source", ["webdataset", "hf"])
def test_shards_and_an_hf_dataset_are_decoded_and_augmented_on_cuda(tmp_path: Path, source: str) -> None:
    """The sharded sources on CUDA (data.decode_on=auto, augment_on=auto): their JPEG members / rows reach the GPU as
    bytes and nvJPEG decodes them in one call per batch, the PNGs in the workers; the corrupt JPEG is skipped and
    counted; the losses are finite. (On the CPU: tests/data/test_shards.py and test_hf.py.)"""
    from helpers import photo_folder

    from sslkit.data.sources import FolderDataset

    photo_folder(tmp_path / "images")
    files = FolderDataset(tmp_path / "images", probe=0).samples
    if source == "webdataset":
        from sslkit.data.shards import pack_images

        pack_images(files, tmp_path / "data", shard_bytes=40_000)
        extra = []
    else:
        datasets = pytest.importorskip("datasets")
        rows = {"image": [{"bytes": Path(f).read_bytes(), "path": None} for f, _ in files],
                "label": [label for _, label in files]}
        features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
        datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "data"))
        extra = ["data.train.kwargs.label_column=label"]
    out = tmp_path / "run"
    proc = run_cli("config=simclr", f"data={source}", f"data.train.path={tmp_path / 'data'}", *extra, *GPU,
                   "model.trunk=small_cnn", "model.trunk_kwargs={width: 8}", "data.image_size=16",
                   "data.small_image_size=8", "data.batch_size=8", "optim.max_steps=3", "eval.knn.enabled=false",
                   "log.every_n_steps=1", "data.num_workers=2", f"output_dir={out}")
    assert "augmented on the training device" in proc.stdout and "decoded on the training device" in proc.stdout
    records = metrics(out)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if r.get("phase") == "train" and "loss" in r)
    assert sum(r.get("unreadable_samples", 0) for r in records) == 1


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_compiles_with_inductor_on_cuda(tmp_path: Path, recipe: str) -> None:
    out = tmp_path / recipe
    proc = run_cli(f"config={recipe}", *SMALL, *RECIPES[recipe], *GPU, "machine.compile=true", "optim.max_steps=3",
                   "eval.knn.enabled=false", "log.every_n_steps=1", f"output_dir={out}")
    assert "compiled with torch.compile (backend inductor" in proc.stdout
    train = [r for r in metrics(out) if r.get("phase") == "train" and "loss" in r]
    assert len(train) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)


def test_the_dino_family_centre_moves_on_the_device_without_a_sync() -> None:
    """sslkit.methods.center.Center on CUDA: the sums, the all-reduce-free update and the "no weight, no move" rule
    stay on the device (no host sync: set_sync_debug_mode raises on one), and the centre is the CPU's to float
    rounding, for unweighted (DINO's CLS) and weighted (iBOT's patches) rows."""
    from sslkit.methods.center import Center

    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)]
    weights = [torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 1.0]), torch.ones(6)]
    centres = {}
    for device in ("cpu", "cuda"):
        cls, patches = Center(8, 0.9).to(device), Center(8, 0.9).to(device)
        # on the device before the watch: a copy from pageable host memory is itself a sync
        here, weighed = [r.to(device) for r in rows], [w.to(device) for w in weights]
        none = torch.zeros(6, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):  # two micro-batches, then the update
                cls.accumulate(here)
                patches.accumulate(here, weighed)
            cls.update()
            patches.update()
            patches.accumulate(here[:1], [none])
            patches.update()  # no weight: stays
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert cls.value.device.type == patches.value.device.type == device
        centres[device] = (cls.value.cpu(), patches.value.cpu())
    for got, want in zip(centres["cuda"], centres["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_distillation_keeps_its_teacher_on_the_gpu_frozen_and_bitwise_unchanged(tmp_path: Path) -> None:
    """Two students (a CNN, a ViT) in bf16 on one teacher forward a step: the teacher, outside the model's
    parameters, was moved to the GPU with it, stays in eval mode and ends every tensor as it began."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    task = build_task(compose_config(["config=distill", *SMALL, *RECIPE_ARGS["distill"], *GPU, "optim.max_steps=3",
                                      "eval.knn.enabled=false", f"output_dir={tmp_path / 'run'}"]))
    teacher = task.base_model.teacher
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    train(task, standard_train_step)
    assert {p.device.type for p in teacher.parameters()} == {"cuda"} and not teacher.training
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics(tmp_path / "run") if "loss" in r)
