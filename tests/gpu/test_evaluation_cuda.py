"""On CUDA: the online monitors, and the tools (knn, linear, extract, export) on a checkpoint trained on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SMALL, metrics, run_main

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU = ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16", "machine.channels_last=true"]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SimCLR run on the GPU with a torchvision ResNet-18 (ImageNet stem): monitors on by auto."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path_factory.mktemp("gpu_eval") / "run"
    run_main("config=simclr", *SMALL, *GPU, "model.trunk=resnet18", "model.trunk_kwargs={}", "optim.epochs=2",
             f"output_dir={out}")
    return out


def test_monitors_are_on_by_default_on_cuda(gpu_run: Path) -> None:
    records = metrics(gpu_run)
    assert any("rankme_features" in r for r in records)
    assert [r["epoch"] for r in records if "online_linear_test_top1" in r] == [0, 1]


def test_tools_on_cuda_and_the_export_loads_on_the_cpu(gpu_run: Path, tmp_path: Path) -> None:
    import torchvision
    from safetensors.torch import load_file

    from sslkit.tools.common import extract_main, knn_main, linear_main
    from sslkit.tools.pretrained import load_pretrained

    assert knn_main([f"checkpoint={gpu_run}"]) == 0
    trained = [r for r in metrics(gpu_run) if "knn_top1" in r][-1]["knn_top1"]
    assert json.loads((gpu_run / "eval" / "knn.json").read_text())["top1"] == pytest.approx(trained, abs=0.02)
    assert linear_main([f"checkpoint={gpu_run}", "eval.linear.epochs=2", "eval.linear.augment=true"]) == 0
    assert extract_main([f"checkpoint={gpu_run}", f"output={tmp_path / 'f.pt'}"]) == 0
    from sslkit.tools.export import export_main

    assert export_main([f"checkpoint={gpu_run}", f"output={tmp_path / 'e.safetensors'}"]) == 0
    model = torchvision.models.resnet18()
    model.fc = torch.nn.Identity()
    model.load_state_dict(load_file(str(tmp_path / "e.safetensors")), strict=True)  # CPU tensors
    pre = load_pretrained(str(gpu_run), ["machine.device=cpu"])  # a GPU checkpoint read on the CPU
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.eval()(x), pre.trunk(x), atol=1e-5)


def test_a_multi_gpu_checkpoint_evaluates_on_this_gpu_and_too_many_extract_processes_are_refused_up_front(
        gpu_run: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The run's config says it trained over more processes than this machine has GPUs: kNN still runs, in one
    process (the evaluation does not inherit the run's process layout). ``sslkit extract`` over more processes than
    GPUs is refused before any process starts (NCCL would refuse two ranks on one GPU), with exit 2 and what to set."""
    import shutil

    from omegaconf import OmegaConf

    from sslkit.launch.cli import console

    n = torch.cuda.device_count() + 1
    copy = tmp_path / "run"
    shutil.copytree(gpu_run, copy)
    for ckpt in (copy / "checkpoints").glob("checkpoint_*.pt"):  # the stored config, as a 4-GPU run writes it
        state = torch.load(ckpt, weights_only=True)
        saved = OmegaConf.create(state["config"])
        saved.distributed.nproc_per_node = n
        state["config"] = OmegaConf.to_yaml(saved)
        torch.save(state, ckpt)
    assert console(["knn", f"checkpoint={copy}"]) == 0
    out = tmp_path / "f.npz"
    assert console(["extract", f"checkpoint={copy}", f"distributed.nproc_per_node={n}", f"output={out}"]) == 2
    said = capfd.readouterr().err
    assert f"Set distributed.nproc_per_node={n - 1}, or machine.device=cpu" in said, said
    assert "Traceback" not in said and not out.exists()


def test_viz_on_cuda_draws_what_the_cpu_draws(tmp_path: Path) -> None:
    """sslkit viz of a tiny ViT on the GPU: the same neighbours and kept patches as on the CPU (the attention and
    features in float32 on both; the kNN memory as the kNN tool reads it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from helpers import RECIPES, run_sslkit

    out = tmp_path / "vit"
    run_main("config=simclr_vit", *SMALL, *RECIPES["simclr_vit"], "optim.max_steps=2", "eval.knn.enabled=false",
             "machine.device=cuda", f"output_dir={out}")
    found = {}
    for device in ("cpu", "cuda"):
        code, _, err = run_sslkit("viz", f"checkpoint={out}", f"machine.device={device}", "n=3", "k=4",
                                  "method=pca", "samples=40", f"output={tmp_path / device}")
        assert code == 0, err
        found[device] = {kind: json.loads((tmp_path / device / kind / f"{kind}.json").read_text())
                         for kind in ("attention", "pca", "neighbors")}
    cpu, cuda = found["cpu"], found["cuda"]
    for a, b in zip(cpu["attention"]["images"], cuda["attention"]["images"]):  # a patch at the boundary may flip
        assert all(abs(x - y) <= 1 for x, y in zip(a["kept_patches"], b["kept_patches"]))
    for a, b in zip(cpu["neighbors"]["queries"], cuda["neighbors"]["queries"]):
        assert a["similarities"] == pytest.approx(b["similarities"], abs=1e-3)
    assert cpu["pca"]["explained_variance_ratio"] == pytest.approx(cuda["pca"]["explained_variance_ratio"], abs=1e-3)


def test_bench_on_cuda_gives_the_cpus_table(gpu_run: Path, tmp_path: Path) -> None:
    """sslkit bench of a GPU-trained run, the pixels and random init on CUDA: every protocol runs there (features,
    kNN, the probe grid, logistic regression, retrieval, corruptions) and its figures are the CPU's within float
    noise (kNN and retrieval identical but for near-ties, the probes within a point)."""
    from helpers import run_sslkit

    quick = ["data=synthetic", "data.train.kwargs.num_samples=200", "+data.test.kwargs.num_samples=100",
             "bench.num_workers=0", "bench.bootstrap=100", "bench.knn.ks=[5,20]", "bench.linear.epochs=2",
             "bench.fewshot.draws=2", "bench.fewshot.shots=[1,0]", "bench.fewshot.val_fraction=0.1",
             "bench.robustness.severities=[1]", "bench.robustness.k=5", f"backbones=[{gpu_run},pixels,random]"]
    figures = {}
    for device in ("cuda", "cpu"):
        code, _, stderr = run_sslkit("bench", *quick, f"machine.device={device}", f"output={tmp_path / device}",
                                     f"bench.cache_dir={tmp_path / 'cache'}")
        assert code == 0, stderr[-3000:]
        r = json.loads((tmp_path / device / "results.json").read_text())
        assert r["device"].startswith(device)
        figures[device] = {(n, m): v["value"] for n in r["backbones"] for m, v in r["results"][n]["metrics"].items()}
    assert figures["cuda"].keys() == figures["cpu"].keys()
    for key, value in figures["cuda"].items():
        assert value == pytest.approx(figures["cpu"][key], abs=0.03), key


def test_the_patch_token_protocols_on_cuda_give_the_cpus_figures(tmp_path: Path) -> None:
    """The attentive probe and the dense protocol (on a few Fashion-MNIST scenes, read through the run's own 32 px
    window) of a GPU-trained ViT, the pixels and its random twin: the same figures on CUDA as on the CPU, within the
    noise of float16 tokens and of the GPU's kernels."""
    from helpers import VIT, run_sslkit

    from sslkit.data.sources import DEBIAN_FASHION_MNIST

    out = tmp_path / "vit"
    run_main("config=simclr_vit", *SMALL, *GPU, *VIT, "optim.max_steps=20", f"output_dir={out}")
    quick = ["data=synthetic", "data.train.kwargs.num_samples=200", "+data.test.kwargs.num_samples=100",
             "bench.num_workers=0", "bench.bootstrap=100", "bench.attentive.epochs=3", "bench.attentive.batch_size=32",
             f"backbones=[{out},pixels,random]"]
    protocols = "protocols=[attentive]"
    if Path(DEBIAN_FASHION_MNIST).is_dir():
        protocols = "protocols=[attentive,dense]"
        quick += ["eval.dense.scenes.train=64", "eval.dense.scenes.test=32", "eval.dense.epochs=3",
                  "eval.dense.batch_size=16"]
    figures = {}
    for device in ("cuda", "cpu"):
        code, _, stderr = run_sslkit("bench", *quick, protocols, f"machine.device={device}",
                                     f"output={tmp_path / device}", f"bench.cache_dir={tmp_path / 'cache'}")
        assert code == 0, stderr[-3000:]
        r = json.loads((tmp_path / device / "results.json").read_text())
        figures[device] = {(n, m): v["value"] for n in r["backbones"] for m, v in r["results"][n]["metrics"].items()}
    assert figures["cuda"].keys() == figures["cpu"].keys() and len(figures["cuda"]) >= 3
    for key, value in figures["cuda"].items():
        assert value == pytest.approx(figures["cpu"][key], abs=0.05), key
