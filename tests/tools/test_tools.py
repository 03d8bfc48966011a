"""The tools on a trained checkpoint: sslkit knn / linear / extract / export, their files and their errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL, metrics, run_main, run_sslkit
from omegaconf import OmegaConf

from sslkit.evaluation import linear as L
from sslkit.tools.export import torchvision_twin

TINY = [*SMALL, "optim.max_steps=2", "log.tensorboard=false"]


sslkit = run_sslkit  # the sslkit command in this process


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny SimCLR run (small CNN, synthetic 3x32x32 data, 2 steps, kNN with k=5 at the end)."""
    out = tmp_path_factory.mktemp("tools") / "simclr"
    run_main("config=simclr", *TINY, f"output_dir={out}")
    return out


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with a torchvision ResNet-18 trunk (ImageNet stem), for the export."""
    out = tmp_path_factory.mktemp("tools") / "resnet"
    run_main("config=simclr", *TINY, "model.trunk=resnet18", "model.trunk_kwargs={}", "optim.max_steps=1",
             "eval.knn.enabled=false", f"output_dir={out}")
    return out


# ---------------------------------------------------------------------------------------------
# kNN
# ---------------------------------------------------------------------------------------------


def test_knn_tool_repeats_the_training_time_knn(run: Path) -> None:
    """The tool on the run folder gives the kNN the run computed at its end (same checkpoint, k, data)."""
    code, _, err = sslkit("knn", f"checkpoint={run}")
    assert code == 0, err
    result = json.loads((run / "eval" / "knn.json").read_text())
    trained = [r for r in metrics(run) if "knn_top1" in r][-1]
    assert result["top1"] == pytest.approx(trained["knn_top1"], abs=1e-9)
    assert result["top5"] == pytest.approx(trained["knn_top5"], abs=1e-9)
    assert result["step"] == 2 and result["checkpoint"].endswith("checkpoint_000000002.pt")
    assert result["config"]["k"] == 5 and result["config"]["temperature"] == 0.1
    assert result["num_train"] == 64 and result["config"]["data"]["train"]["source"] == "synthetic"


def test_knn_tool_on_a_copied_file_with_overrides(run: Path, tmp_path: Path) -> None:
    """A checkpoint file taken out of its folder still carries its config; eval.* overrides apply, output= is
    where the JSON goes."""
    ckpt = next((run / "checkpoints").glob("checkpoint_*.pt"))
    alone = tmp_path / "model.pt"
    shutil.copy(ckpt, alone)
    code, _, err = sslkit("knn", f"checkpoint={alone}", "eval.knn.k=3", "features=projector",
                          f"output={tmp_path / 'k3.json'}")
    assert code == 0, err
    result = json.loads((tmp_path / "k3.json").read_text())
    assert result["config"]["k"] == 3 and result["features"] == "projector" and result["step"] == 2


@pytest.mark.parametrize("args, words", [
    ((), "needs checkpoint="),
    (("checkpoint=/nonexistent/run",), "no such file or folder"),
    (("checkpoint={run}", "eval.knn.tempreature=3"), "Did you mean 'eval.knn.temperature'"),
    (("checkpoint={run}", "outptu=x.json"), "Did you mean 'output'"),
    (("checkpoint={run}", "features=head"), "features=head"),
])
def test_knn_tool_errors_are_messages(run: Path, args: tuple[str, ...], words: str) -> None:
    code, _, err = sslkit("knn", *(a.format(run=run) for a in args))
    assert code == 2
    assert words in err and "Traceback" not in err


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "bad.pt"
    torch.save({"model": Evil()}, bad)
    code, out, err = sslkit("knn", f"checkpoint={bad}")
    assert code == 2 and "refuses this file" in err and "pwned" not in out


def test_unlabelled_data_is_told_to_give_labelled_sets(run: Path) -> None:
    """A run whose evaluation data has no labels: the tool says which keys give labelled sets."""
    code, _, err = sslkit("knn", f"checkpoint={run}", "data.train.kwargs.num_classes=0")
    assert code == 2 and "has no labels" in err and "eval.data.train.path" in err


# ---------------------------------------------------------------------------------------------
# Linear probe
# ---------------------------------------------------------------------------------------------


def test_cosine_lr_and_accuracy_by_hand() -> None:
    assert L.cosine_lr(0.4, 0, 10) == pytest.approx(0.4)
    assert L.cosine_lr(0.4, 5, 10) == pytest.approx(0.2)
    assert L.cosine_lr(0.4, 10, 10) == pytest.approx(0.0)
    head = torch.nn.Linear(2, 6, bias=False)
    with torch.no_grad():  # logits = features @ W^T; W picks classes: rows 0..5
        head.weight.copy_(torch.tensor([[1.0, 0], [0, 1], [1, 1], [0, 0], [-1, 0], [0, -1]]))
    feats = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    # sample 0: logits [2,0,2,0,-2,0] -> tie between class 0 and 2 -> 0; sample 1: [0,3,3,0,0,-3] -> 1;
    # sample 2: [1,1,2,0,-1,-1] -> 2
    acc = L.accuracy(head, feats, torch.tensor([2, 1, 2]), num_classes=6)
    assert acc["top1"] == pytest.approx(2 / 3) and acc["top5"] == pytest.approx(1.0)


def test_probe_learns_a_separable_problem_from_zero() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    s = L.LinearSettings(epochs=20, batch_size=32, lr=0.1)
    head = L.make_classifier(8, 2, torch.device("cpu"))
    assert L.accuracy(head, x, y, 2)["top1"] == pytest.approx((y == 0).float().mean().item())  # all class 0
    opt = L.make_optimizer(head, s)
    step = 0
    total = 20 * -(-400 // 32)
    for epoch in range(20):
        order = torch.Generator().manual_seed(epoch)
        _, step = L.train_epoch(head, opt, L.feature_batches(x, y, 32, order),
                                lambda t: L.cosine_lr(s.scaled_lr, t, total), step)
    assert step == total
    assert L.accuracy(head, x, y, 2)["top1"] > 0.97


def test_linear_tool_writes_every_epoch_and_resumes_exactly(run: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted probe resumes from its last epoch and ends with the figures of an uninterrupted one."""
    args = ("linear", f"checkpoint={run}", "eval.linear.epochs=4", "eval.linear.batch_size=16")
    code, _, err = sslkit(*args, f"output={tmp_path / 'whole.json'}")
    assert code == 0, err
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert [r["epoch"] for r in whole["epochs"]] == [1, 2, 3, 4] and whole["done"]
    assert whole["top1"] == whole["epochs"][-1]["top1"] and 0 <= whole["top1"] <= 1 and "top5" in whole
    assert whole["step"] == 2 and whole["config"]["scaled_lr"] == pytest.approx(0.1 * 16 / 256)
    assert whole["config"]["augment"] is False  # the synthetic preset computes features once

    calls = {"n": 0}
    real = L.accuracy

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    import sslkit.tools.common as T

    monkeypatch.setattr(T, "accuracy", interrupted)
    code, _, err = sslkit(*args, f"output={tmp_path / 'cut.json'}")
    assert code == 130 and "resumes" in err
    cut = json.loads((tmp_path / "cut.json").read_text())
    assert len(cut["epochs"]) == 2 and not cut["done"]
    monkeypatch.setattr(T, "accuracy", real)
    code, out, err = sslkit(*args, f"output={tmp_path / 'cut.json'}")
    assert code == 0 and "resuming from epoch 2" in out
    resumed = json.loads((tmp_path / "cut.json").read_text())
    assert resumed["epochs"] == whole["epochs"]  # bit-identical losses and accuracies


def test_linear_tool_with_augmentation(run: Path, tmp_path: Path) -> None:
    """eval.linear.augment=true: crops and flips every epoch through the frozen trunk (the paper's protocol)."""
    code, _, err = sslkit("linear", f"checkpoint={run}", "eval.linear.epochs=2", "eval.linear.augment=true",
                          "eval.linear.batch_size=16", f"output={tmp_path / 'aug.json'}")
    assert code == 0, err
    result = json.loads((tmp_path / "aug.json").read_text())
    assert result["config"]["augment"] is True and len(result["epochs"]) == 2
    assert all(np.isfinite(r["train_loss"]) for r in result["epochs"])


# ---------------------------------------------------------------------------------------------
# Feature extraction
# ---------------------------------------------------------------------------------------------


def test_extract_gives_the_trunks_features_in_dataset_order(run: Path, tmp_path: Path) -> None:
    from sslkit.data import build_source, build_transform
    from sslkit.tools.pretrained import load_pretrained

    code, _, err = sslkit("extract", f"checkpoint={run}", "split=test", f"output={tmp_path / 'f.npz'}")
    assert code == 0, err
    got = np.load(tmp_path / "f.npz")
    source = build_source("synthetic", "test", None)  # the test split: its own 512 samples
    assert got["features"].shape == (512, 8 * 8 * 16)  # small_cnn width 8, 4x4 grid
    assert got["indices"].tolist() == list(range(512))
    assert got["labels"].tolist() == [source[i][1] for i in range(512)]
    pre = load_pretrained(str(run), ["machine.device=cpu"])
    view = build_transform("eval", image_size=32)(source[5][0])[0]
    with torch.no_grad():
        expected = pre.trunk(view[None])[0]
    assert torch.allclose(torch.from_numpy(got["features"][5]), expected, atol=1e-5)

    code, _, err = sslkit("extract", f"checkpoint={run}", "split=train", "features=projector",
                          f"output={tmp_path / 'p.pt'}")
    assert code == 0, err
    saved = torch.load(tmp_path / "p.pt", weights_only=True)
    assert saved["features"].shape == (64, 16) and saved["labels"].shape == (64,)


def test_extract_with_two_processes_equals_one(run: Path, tmp_path: Path) -> None:
    """distributed.nproc_per_node=2: each process takes half the samples; the file is the same, in order, with the
    sampler's padding dropped (63 samples over 2 processes)."""
    common = (f"checkpoint={run}", "split=test", "data.limit=63")
    assert sslkit("extract", *common, f"output={tmp_path / 'one.npz'}")[0] == 0
    code, _, err = sslkit("extract", *common, "distributed.nproc_per_node=2", f"output={tmp_path / 'two.npz'}")
    assert code == 0, err
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert two["indices"].tolist() == list(range(63))
    np.testing.assert_allclose(two["features"], one["features"], atol=1e-6)
    assert two["labels"].tolist() == one["labels"].tolist()


def test_the_runs_process_layout_does_not_carry_into_an_evaluation(run: Path) -> None:
    """A checkpoint trained over 4 processes on 2 nodes with NCCL is evaluated in one process here (its layout,
    kept, fails the device check: NCCL on a CPU, or 4 processes on a 1-GPU machine); an override still applies."""
    from sslkit.tools.pretrained import eval_config

    saved = OmegaConf.load(run / "config.yaml")
    saved.distributed.update(nproc_per_node=4, num_nodes=2, node_rank=1, backend="nccl", master_port=29500)
    cfg = eval_config(saved, [])
    assert (cfg.distributed.nproc_per_node, cfg.distributed.num_nodes, cfg.distributed.node_rank) == (1, 1, 0)
    assert cfg.distributed.backend == "auto" and cfg.distributed.master_port == 0
    assert eval_config(saved, ["distributed.nproc_per_node=2"]).distributed.nproc_per_node == 2


def test_extract_over_two_processes_says_a_user_error_once_without_a_traceback(run: Path, tmp_path: Path,
                                                                               capfd: pytest.CaptureFixture) -> None:
    """A bad checkpoint is refused before any process starts; an error inside the workers (here the evaluation
    set's folder is missing, found when each worker builds it) is said once, by rank 0, with exit 2."""
    out = tmp_path / "f.npz"
    code, _, err = sslkit("extract", f"checkpoint={tmp_path / 'nowhere'}", "distributed.nproc_per_node=2",
                          f"output={out}")
    assert code == 2 and "sslkit extract: error: checkpoint=" in err and "no such file or folder" in err
    code, _, err = sslkit("extract", f"checkpoint={run}", "distributed.nproc_per_node=2", f"output={out}",
                          "eval.data.train.source=folder", f"eval.data.train.path={tmp_path / 'missing'}",
                          f"eval.data.test.path={tmp_path / 'missing'}")
    said = capfd.readouterr().err + err
    assert code == 2, said
    assert said.count("sslkit extract: error:") == 1 and str(tmp_path / "missing") in said, said
    assert "Traceback" not in said
    assert re.search(r"sslkit extract: worker [01] stopped \(exit 2, its message is above\)", said), said
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def test_export_loads_strictly_into_torchvision_and_gives_the_same_features(resnet_run: Path,
                                                                             tmp_path: Path) -> None:
    import torchvision
    from safetensors.torch import load_file

    from sslkit.tools.pretrained import load_pretrained

    out = tmp_path / "encoder.safetensors"
    code, _, err = sslkit("export", f"checkpoint={resnet_run}", f"output={out}")
    assert code == 0, err
    model = torchvision.models.resnet18(weights=None)
    model.fc = torch.nn.Identity()
    model.load_state_dict(load_file(str(out)), strict=True)
    model.eval()
    pre = load_pretrained(str(resnet_run), ["machine.device=cpu"])
    x = torch.rand(3, 3, 40, 48)
    with torch.no_grad():
        assert torch.allclose(model(x), pre.trunk(x), atol=1e-5)
    meta = json.loads((tmp_path / "encoder.json").read_text())
    assert meta["input"]["mean"] == [0.5] * 3 and meta["input"]["std"] == [0.5] * 3
    assert meta["architecture"] == "torchvision.models.resnet18" and meta["feature_dim"] == 512
    assert meta["step"] == 1


def test_export_of_a_trunk_without_torchvision_twin_says_what_differs(run: Path, tmp_path: Path) -> None:
    code, _, err = sslkit("export", f"checkpoint={run}", f"output={tmp_path / 'e.safetensors'}")
    assert code == 2 and "no torchvision twin" in err and "small_cnn" in err and "twin=none" in err
    code, _, err = sslkit("export", f"checkpoint={run}", "twin=none", f"output={tmp_path / 'e.pt'}")
    assert code == 0, err
    state = torch.load(tmp_path / "e.pt", weights_only=True)
    assert "features.0.weight" in state
    cfg = OmegaConf.create({"model": {"trunk": "resnet50", "trunk_kwargs": {"small_image_stem": True}}})
    twin, why = torchvision_twin(cfg, 3)
    assert twin is None and "3x3 with stride 1" in why and "max-pool" in why
    cfg = OmegaConf.create({"model": {"trunk": "resnet50", "trunk_kwargs": {}}})
    assert torchvision_twin(cfg, 3) == ("resnet50", "") and torchvision_twin(cfg, 1)[0] is None


def test_a_checkpoint_without_its_config_is_refused_with_what_to_do(run: Path, tmp_path: Path) -> None:
    """Every checkpoint sslkit writes holds its run's config; one without it (not written by this sslkit, or edited)
    stops the tool with a message, even where a config.yaml lies beside it (no reading of older formats)."""
    copy = tmp_path / "old"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval"))
    ckpt = next((copy / "checkpoints").glob("checkpoint_*.pt"))
    state = torch.load(ckpt, weights_only=True)
    del state["config"]
    torch.save(state, ckpt)
    assert (copy / "config.yaml").exists()
    code, _, err = sslkit("knn", f"checkpoint={copy}")
    assert code == 2 and "holds no config" in err and "model.pretrained" in err and "Traceback" not in err


def test_tools_scripts_and_console_share_one_grammar() -> None:
    code, out, _ = sslkit("--help")
    assert code == 0 and all(c in out for c in ("train", "knn", "linear", "extract", "export", "report"))
    code, _, err = sslkit("lienar")
    assert code == 2 and "Did you mean 'linear'" in err
    code, out, _ = sslkit("linear", "--help")
    assert code == 0 and "eval.linear" in out


def test_a_run_on_unlabelled_images_is_measured_on_eval_data(tmp_path: Path) -> None:
    """Training data without labels: kNN at the end of training uses eval.data.*; without them it is skipped with
    the keys to set, and the tools say the same."""
    unlabelled = ("config=simclr", *TINY, "data.train.kwargs.num_classes=0")
    out = tmp_path / "with"
    run_main(*unlabelled, "eval.data.train.source=synthetic", "eval.data.train.kwargs={num_samples: 48}",
             f"output_dir={out}")
    final = [r for r in metrics(out) if "knn_top1" in r]
    assert len(final) == 1 and 0 <= final[0]["knn_top1"] <= 1
    code, _, err = sslkit("knn", f"checkpoint={out}")
    assert code == 0, err
    result = json.loads((out / "eval" / "knn.json").read_text())
    assert result["num_train"] == 48 and result["config"]["data"]["train"]["from"] == "eval.data.train"
    assert result["top1"] == pytest.approx(final[0]["knn_top1"])

    out = tmp_path / "without"
    proc = run_main(*unlabelled, f"output_dir={out}")
    assert "kNN evaluation skipped" in proc.stdout and "eval.data.train.path" in proc.stdout
    assert not [r for r in metrics(out) if "knn_top1" in r]
