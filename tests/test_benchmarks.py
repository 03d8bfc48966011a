"""benchmarks/overhead.py: its plain loop runs under sslkit's precision policy and method hooks, so the
weights of both loops come out bit-identical, and a plain loop that ignored either would not."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import forkrun
import pytest
import torch
from helpers import HANG_S, REPO, SMALL
from helpers import RECIPES as HELPER_RECIPES
from omegaconf import OmegaConf

from sslkit.data.sources import DEBIAN_FASHION_MNIST

TINY = [*SMALL, "machine.device=cpu"]
BF16 = ["amp.enabled=true", "amp.dtype=bfloat16"]
RECIPES = {  # small settings of the recipes whose method hooks change weights
    "byol": (["model.kwargs.predictor_hidden_dim=32"], {"MomentumTeacherHook"}),
    "swav": (["loss.queue_length=32", "model.kwargs.num_prototypes=10", "data.transform.num_small=2"],
             {"SwAVPrototypesHook"}),
    "dino": (["data.transform.num_small=2", "model.head.bottleneck_dim=8"],
             {"MomentumTeacherHook", "FreezeLastLayerHook"}),
    # the masked ViT methods: masks from the sample stage, the centres, clipping (dinov2 is ibot's model and loop)
    "ibot": (HELPER_RECIPES["ibot"], {"MomentumTeacherHook", "FreezeLastLayerHook"}),
    "ijepa": (HELPER_RECIPES["ijepa"], {"MomentumTeacherHook"}),
}


@pytest.fixture(scope="module")
def overhead() -> ModuleType:
    """benchmarks/overhead.py as a module; SSLKIT_MALLOC_TUNED keeps its import from re-executing pytest."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSLKIT_MALLOC_TUNED", "1")
        spec = importlib.util.spec_from_file_location("sslkit_bench_overhead", REPO / "benchmarks" / "overhead.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def _cfg(overhead: ModuleType, tmp_path: Path, *overrides: str, steps: int = 4):
    return overhead.bench_config(steps, [*TINY, *overrides], str(tmp_path))


@pytest.mark.slow
def test_cli_bf16_prints_machine_ratio_and_identical_weights(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("SSLKIT_MALLOC_TUNED", None)
    proc = forkrun.run(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--steps", "4", "--rounds", "1", "--warmup", "1",
         *TINY, *BF16], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^machine: .+ cores .+ torch \S+", out, re.M), out
    assert re.search(r"^device cpu, precision bf16 autocast, channels_last True", out, re.M), out
    assert re.search(r"^round 0: sslkit [\d.]+ ms/step median, [\d.]+ mean; plain .* weights identical: True$", out,
                     re.M), out
    for label in ("median step", "mean step"):
        assert re.search(rf"^{label}: sslkit [\d.]+ ms, plain PyTorch [\d.]+ ms, ratio \d+\.\d{{3}} \(overhead",
                         out, re.M), out
    assert "weights after 4 steps identical (torch.equal, every tensor, every round): True" in out


@pytest.mark.parametrize("precision", [BF16, ["amp.enabled=false"]], ids=["bf16", "fp32"])
def test_plain_loop_matches_sslkit_and_the_check_sees_a_precision_mismatch(overhead, tmp_path, precision) -> None:
    cfg = _cfg(overhead, tmp_path, *precision)
    ours = overhead.sslkit_loop(cfg, 1)
    plain = overhead.plain_loop(cfg, 1)
    assert overhead.identical(ours.weights, plain.weights)
    assert len(ours.step_times) == len(plain.step_times) == 3 and ours.block_steps == plain.block_steps == 3
    # The same plain loop in the other precision (e.g. one that ignores autocast) must not pass the check.
    other = _cfg(overhead, tmp_path, "amp.enabled=false" if cfg.amp.enabled else "amp.enabled=true")
    mismatch = overhead.plain_loop(other, 1).weights
    assert not overhead.identical(ours.weights, mismatch)
    key, diff = overhead.largest_difference(ours.weights, mismatch)
    assert key in ours.weights and diff > 0
    assert overhead.largest_difference(ours.weights, plain.weights) == ("", 0.0)


@pytest.mark.parametrize("overrides", [["amp.enabled=true", "amp.dtype=float16"], ["optim.micro_batches=2"]],
                         ids=["fp16-gradscaler", "accumulate2"])
def test_plain_loop_matches_with_gradscaler_and_accumulation(overhead, tmp_path, overrides) -> None:
    cfg = _cfg(overhead, tmp_path, *overrides, "data.train.kwargs.num_samples=128")
    assert overhead.identical(overhead.sslkit_loop(cfg, 1).weights, overhead.plain_loop(cfg, 1).weights)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_method_hooks_run_in_the_plain_loop(overhead, tmp_path, monkeypatch, recipe) -> None:
    extra, expected = RECIPES[recipe]
    # 6 steps of 4 per epoch: DINO's last layer is frozen in epoch 0 and trained in epoch 1.
    cfg = _cfg(overhead, tmp_path, f"config={recipe}", *extra, *BF16, steps=6)
    ours = overhead.sslkit_loop(cfg, 1)
    plain = overhead.plain_loop(cfg, 1)
    assert overhead.identical(ours.weights, plain.weights)
    shared = {type(h).__name__ for h in overhead.method_hooks(overhead.build_task(cfg))}
    assert expected <= shared and not shared & {"LogHook", "CheckpointHook", "NonFiniteLossHook", "PreemptionHook"}
    monkeypatch.setattr(overhead, "method_hooks", lambda task: [])  # a plain loop without the method's hooks
    assert not overhead.identical(ours.weights, overhead.plain_loop(cfg, 1).weights)


def test_clock_times_the_steps_after_warmup(overhead) -> None:
    clock = overhead.Clock(torch.device("cpu"), warmup=2, total=5)
    clock.start()
    for _ in range(5):
        clock.step()
    assert len(clock.intervals()) == 3 and clock.block_seconds() >= 0
    with pytest.raises(ValueError, match="no step to time"):
        overhead.Clock(torch.device("cpu"), warmup=5, total=5)


def test_refuses_what_the_plain_loop_does_not_mirror(overhead) -> None:
    task = SimpleNamespace(config=OmegaConf.create({"train_step": "mine"}), world_size=1, phases=[])
    with pytest.raises(SystemExit, match="only the standard train step"):
        overhead.check_supported(task)
    task = SimpleNamespace(config=OmegaConf.create({"train_step": "standard"}), world_size=2, phases=[])
    with pytest.raises(SystemExit, match="one process"):
        overhead.check_supported(task)


@pytest.mark.slow
def test_throughput_quick_prints_every_pipeline_with_its_ratio(tmp_path: Path) -> None:
    """benchmarks/throughput.py on the CPU, the JPEG preset with a small trunk: it writes its JPEG folder, times
    (a) the raw step, (b) and (c) for the three pipelines, and prints the table with c / a = step / raw."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("SSLKIT_MALLOC_TUNED", None)
    proc = forkrun.run(
        [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--device", "cpu", "--quick", "--presets",
         "simclr_rn50", "--steps", "2", "--warmup", "1", "model.trunk=small_cnn", "model.trunk_kwargs={width: 8}"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^machine: .+ cores", proc.stdout, re.M), proc.stdout
    rows = re.findall(r"^\| simclr_rn50 \| (\S+) \| 2x64 \| 16 \| (\S+) \| \d+ \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| "
                      r"([\d.]+) \| - \|$", proc.stdout, re.M)  # a CNN: no attention kernel
    assert [r[1] for r in rows] == ["workers", "device", "device+decode"], proc.stdout
    for _trunk, _pipeline, loader, step, raw, ratio in rows:
        step_rate, raw_rate = (float(v.replace(",", "")) for v in (step, raw))
        assert float(loader.replace(",", "")) > 0 and step_rate > 0
        # the rates are printed rounded to whole images/s: the ratio (of the unrounded ones) within that rounding
        rounding = step_rate / raw_rate * (0.5 / step_rate + 0.5 / raw_rate)
        assert float(ratio) == pytest.approx(step_rate / raw_rate, abs=0.01 + rounding)


def _throughput_module() -> ModuleType:
    """benchmarks/throughput.py imported in this process."""
    if "sslkit_bench_throughput" in sys.modules:
        return sys.modules["sslkit_bench_throughput"]
    with pytest.MonkeyPatch.context() as mp:  # SSLKIT_MALLOC_TUNED keeps its import from re-executing pytest
        mp.setenv("SSLKIT_MALLOC_TUNED", "1")
        mp.syspath_prepend(str(REPO / "benchmarks"))  # it imports overhead.py by module name
        spec = importlib.util.spec_from_file_location("sslkit_bench_throughput", REPO / "benchmarks" / "throughput.py")
        assert spec is not None and spec.loader is not None
        throughput = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = throughput  # dataclasses look their module up
        spec.loader.exec_module(throughput)
    return throughput


@pytest.mark.multiprocess
@pytest.mark.beside
def test_throughput_strategy_times_ddp_and_fsdp_on_two_processes(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """--strategy ddp,fsdp on 2 CPU processes: (a) and (c) under each strategy for a ViT preset with c / a =
    step / raw, a CNN preset refused under fsdp in its row; a single process or an unknown strategy is refused."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("SSLKIT_MALLOC_TUNED", None)
    base = [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--device", "cpu", "--quick"]
    proc = forkrun.run([*base, "--presets", "mae_vit_s16", "--strategy", "ddp,fsdp", "--steps", "1", "--warmup",
                           "1", "model.trunk_kwargs.depth=2", "model.kwargs.decoder_depth=1"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^machine: .+ cores", proc.stdout, re.M) and "2 processes; images/s over all" in proc.stdout
    rows = re.findall(r"^\| mae_vit_s16 \| (ddp|fsdp) \| 1x64 \| 16 \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| - \|$",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["ddp", "fsdp"], proc.stdout
    for _strategy, step, raw, ratio in rows:
        step_rate, raw_rate = (float(v.replace(",", "")) for v in (step, raw))
        assert step_rate > 0 and float(ratio) == pytest.approx(step_rate / raw_rate, rel=0.05)  # (rates rounded)
    throughput = _throughput_module()
    from sslkit.config.schema import ConfigError

    (tmp_path / "a.jpg").touch()  # the JPEG presets' folder (the config check looks for an image file)

    def fsdp_config(name: str) -> object:  # what each process composes for a preset under fsdp
        preset = throughput._quick(throughput.PRESETS[name])
        return throughput.bench_config(2, [*throughput.preset_overrides(preset, tmp_path, 64, "cpu"),
                                           "distributed.strategy=fsdp"], str(tmp_path / name))

    with pytest.raises(ConfigError) as refused:  # a CNN: its fsdp row says the config check's refusal
        fsdp_config("rn18_32")
    assert "distributed.strategy" in throughput._refusal(refused.value) and "\n" not in throughput._refusal(
        refused.value)
    for name in (n for n in throughput.PRESETS if "vit" in n):  # every ViT preset is timed under fsdp
        fsdp_config(name)
    for bad, said in ((["--strategy", "zero3"], "choose ddp, fsdp"), (["--strategy", "fsdp", "--nproc", "1"],
                                                                       "needs 2 processes")):
        assert throughput.main(["--device", "cpu", *bad]) == 2
        assert said in capsys.readouterr().err


def test_throughput_names_the_attention_kernel_a_vit_runs(tmp_path: Path) -> None:
    """The ViT presets' table column: the scaled_dot_product_attention kernels seen in a profiled step (the CPU's
    flash kernel here; on CUDA flash, efficient or cudnn), '-' for a model without attention."""
    throughput = _throughput_module()
    from helpers import RECIPES

    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config

    for recipe, views, expected in (("mae", 1, {"flash_cpu", "math"}), ("simclr", 2, {"-"})):
        preset = throughput.Preset(recipe, [], jpeg=False, image_size=32, batch=4, num_large=views)
        cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], "eval.knn.enabled=false",
                              f"output_dir={tmp_path / recipe}"])
        task = build_task(cfg)
        found = throughput.attention_kernels(task, preset)
        task.close()
        assert set(found.split(", ")) <= expected and found, found


def test_the_data_sources_benchmark_prints_decode_limits_start_up_and_rates_per_worker(tmp_path: Path,
                                                                                        capsys) -> None:
    """benchmarks/data_sources.py --quick --remote in this process: 2000 JPEGs as shards and as an HF dataset, the
    shards also over HTTP, and every row of its table with a positive figure."""
    pytest.importorskip("datasets")
    import importlib.util

    spec = importlib.util.spec_from_file_location("sslkit_bench_data", REPO / "benchmarks" / "data_sources.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--workers", "1", "--scratch", str(tmp_path), "--remote", "--latency-ms", "5"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (.+?) \| ([\d,.]+) (?:img/s|s) \|$", out, re.M))
    for name in ("decode limit, one core: PIL, 64 px",
                 "decode limit, one core: torchvision.io.decode_jpeg, 500 x 375 px", "shards, index built",
                 "webdataset, 1 worker(s): decode + 2 SimCLR views, per worker",
                 "hf, 1 worker(s): time to the first batch (index cached)",
                 "remote shards: the index built from the tar headers over HTTP",
                 "remote shards, 5 ms a request, ranged reads, 1 worker(s), per worker",
                 "remote shards, 5 ms a request, whole shards fetched (data.cache_gb, data.order=shards), 1 worker(s), "
                 "per worker"):
        assert name in rows, out
    assert float(rows["webdataset, 1 worker(s): decode + 2 SimCLR views, per worker"].replace(",", "")) > 0
    assert len(list((tmp_path / "shards").glob("*.tar"))) == 1 and (tmp_path / "hf" / "state.json").exists()


@pytest.mark.slow
def test_bench_speed_prints_both_ratios(tmp_path: Path) -> None:
    """benchmarks/bench_speed.py: extraction against the raw forward, the grid against the probes one by one (no time
    is asserted: the figures go to docs/results.md)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = forkrun.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_speed.py"), "--device", "cpu", "--images", "64",
         "--rounds", "1", "--probe-samples", "300", "--probe-dim", "8", "--probe-epochs", "1"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^machine: .+ torch \S+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^extraction \(small_cnn, 64 images .*ratio \d+\.\d\d$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^linear probes \(26 of them, .*speed-up \d+\.\dx$", proc.stdout, re.M), proc.stdout


def _run_benchmark(name: str, args: list[str], cwd: Path) -> str:
    """benchmarks/NAME run as a user would (a process of its own: it sets torch's threads); its stdout."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = forkrun.run([sys.executable, str(REPO / "benchmarks" / name), *args], capture_output=True, text=True,
                       cwd=cwd, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(not Path(DEBIAN_FASHION_MNIST).is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_the_wild_generator_benchmark_prints_its_three_rates(tmp_path: Path) -> None:
    """benchmarks/wild_generator.py --quick: the renderer, sslkit data wild and PIL's floor, each a positive rate,
    the ratios against the floor (no time asserted: the figures go to docs/results.md); its scratch sets removed."""
    out = _run_benchmark("wild_generator.py", ["--quick", "--photos", "dead_leaves", "--scratch", str(tmp_path)],
                         tmp_path)
    assert re.search(r"^1000 images of 32 px from dead_leaves", out, re.M), out
    rows = {name: (rate, ratio) for name, rate, ratio in
            re.findall(r"^\| (.+?) \| ([\d,]+) \| [\d,]+ \| (\d+\.\d\d) \|$", out, re.M)}
    assert set(rows) == {"render (no files)", "sslkit data wild, 1 worker(s)", "plain (PIL writes the rendered images)"}
    assert all(float(rate.replace(",", "")) > 0 for rate, _ in rows.values())
    assert rows["plain (PIL writes the rendered images)"][1] == "1.00"
    assert not list(tmp_path.iterdir())


def test_the_linear_probe_check_compares_the_grid_with_scikit_learn(tmp_path: Path) -> None:
    """benchmarks/linear_probe_check.py --quick: both classifiers' test top-1 on the same (random, separable)
    features, far above chance, their difference the two figures' (the closeness itself is
    tests/evaluation/test_bench_protocols.py's)."""
    out = _run_benchmark("linear_probe_check.py", ["--quick", "--cs", "0.1", "1"], tmp_path)
    figures = json.loads(out.strip().splitlines()[-1])
    assert [r["C"] for r in figures["by_c"]] == [0.1, 1.0]
    assert figures["grid"] > 0.5 and figures["sklearn"] > 0.5, figures
    diff = float(re.search(r"^difference \(grid - scikit-learn\): ([+-]\d\.\d{4})$", out, re.M).group(1))
    assert diff == pytest.approx(figures["grid"] - figures["sklearn"], abs=1e-4)
