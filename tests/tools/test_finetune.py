"""sslkit finetune: MAE's fine-tuning protocol on a CNN and a ViT, its pieces by hand, its file, its exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import RECIPES, SMALL, run_main, run_sslkit
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import sslkit.tools.finetune as FT
from sslkit.evaluation import FeatureEncoder
from sslkit.evaluation.linear import warmup_cosine_lr
from sslkit.models.vit import build_vit

TINY = [*SMALL, "optim.max_steps=2", "log.tensorboard=false", "eval.knn.enabled=false"]
#: Fine-tuning on 128 labelled synthetic images (10 classes), tested on 128 others; 4 steps of 32 per epoch.
FINETUNE = ["data.train.kwargs.num_samples=128", "data.test.kwargs={num_samples: 128}", "eval.finetune.batch_size=32",
            "eval.finetune.warmup_epochs=1"]


sslkit = run_sslkit  # the sslkit command in this process


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SimCLR run with sslkit's small CNN (2 steps)."""
    out = tmp_path_factory.mktemp("finetune") / "cnn"
    run_main("config=simclr", *TINY, f"output_dir={out}")
    return out


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SimCLR ViT run (2 blocks of 192-d tokens, 8 px patches; 2 steps)."""
    out = tmp_path_factory.mktemp("finetune") / "vit"
    run_main("config=simclr_vit", *TINY, *RECIPES["simclr_vit"], f"output_dir={out}")
    return out


# ---------------------------------------------------------------------------------------------
# The protocol's pieces, by hand
# ---------------------------------------------------------------------------------------------


def test_smoothed_cross_entropy_is_the_label_smoothing_loss() -> None:
    """(1 - s) * NLL + s * the mean over classes of -log p: by hand on 2 x 3 logits, and torch's own label smoothing
    (the same definition) on random ones."""
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    target = torch.tensor([0, 1])
    log_p = logits - logits.exp().sum(dim=1, keepdim=True).log()
    by_hand = sum(0.9 * -log_p[i, target[i]] + 0.1 * -log_p[i].sum() / 3 for i in range(2)) / 2
    assert FT.smoothed_cross_entropy(logits, target, 0.1).item() == pytest.approx(by_hand.item(), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(16, 10, generator=g), torch.randint(0, 10, (16,), generator=g)
    for s in (0.0, 0.1, 0.3):
        torch.testing.assert_close(FT.smoothed_cross_entropy(logits, target, s),
                                   F.cross_entropy(logits, target, label_smoothing=s))


def test_warmup_then_cosine_to_min_lr() -> None:
    base, low = 1e-3, 1e-6
    assert warmup_cosine_lr(base, 0, 10, 110, min_lr=low) == 0.0
    assert warmup_cosine_lr(base, 5, 10, 110, min_lr=low) == pytest.approx(base / 2)
    assert warmup_cosine_lr(base, 10, 10, 110, min_lr=low) == pytest.approx(base)
    assert warmup_cosine_lr(base, 60, 10, 110, min_lr=low) == pytest.approx(low + (base - low) / 2)
    assert warmup_cosine_lr(base, 110, 10, 110, min_lr=low) == pytest.approx(low)
    assert warmup_cosine_lr(base, 0, 0, 10, min_lr=low) == pytest.approx(base)  # no warmup


def _layer(name: str, depth: int) -> int:
    """MAE's layer of a parameter of the classifier (util/lr_decay.py get_layer_id_for_vit), written out: the
    embeddings 0, block i i + 1, the rest (final norm, head) depth + 1."""
    name = name.removeprefix("encoder.trunk.")
    if name.split(".")[0] in ("cls_token", "reg_token", "pos_embed", "patch_embed"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def test_layer_wise_decay_and_weight_decay_of_the_optimizer_groups() -> None:
    depth, decay = 3, 0.5
    trunk = build_vit("vit_tiny", 3, img_size=16, patch_size=8, depth=depth, num_heads=2)
    model = FT.Classifier(FeatureEncoder(trunk), FT.make_head(192, 10, 2e-5, torch.device("cpu")))
    s = FT.FinetuneSettings(batch_size=512, blr=1e-3, layer_decay=decay, weight_decay=0.05)
    optimizer = FT.make_optimizer(model, s)
    assert s.lr == pytest.approx(2e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            assert group["lr"] == pytest.approx(s.lr * decay ** (depth + 1 - _layer(name, depth))), name
            no_decay = p.ndim <= 1 or name.endswith(("pos_embed", "cls_token"))
            assert group["weight_decay"] == (0.0 if no_decay else 0.05), name
            seen += 1
    assert seen == len(names)
    assert any(g["lr"] == pytest.approx(s.lr * decay ** 4) for g in optimizer.param_groups)  # the embeddings


def test_drop_path_rises_over_the_blocks_as_timm_builds_it() -> None:
    """A trunk pretrained without stochastic depth gets timm's rates for drop_path_rate=0.2 (0 for the first block,
    an identity), and 0 takes them away again."""
    trunk = build_vit("vit_tiny", 3, img_size=16, patch_size=8, depth=4, num_heads=2)
    reference = VisionTransformer(img_size=16, patch_size=8, embed_dim=192, depth=4, num_heads=2, drop_path_rate=0.2)
    rates = FT.set_drop_path(trunk, 0.2)
    assert rates == pytest.approx([0.0, 0.2 / 3, 0.4 / 3, 0.2])
    for ours, theirs in zip(trunk.blocks, reference.blocks, strict=True):
        for name in ("drop_path1", "drop_path2"):
            assert type(getattr(ours, name)) is type(getattr(theirs, name))
            assert getattr(getattr(ours, name), "drop_prob", 0.0) == getattr(getattr(theirs, name), "drop_prob", 0.0)
    FT.set_drop_path(trunk, 0.0)
    assert all(isinstance(b.drop_path1, nn.Identity) and isinstance(b.drop_path2, nn.Identity) for b in trunk.blocks)


# ---------------------------------------------------------------------------------------------
# The tool
# ---------------------------------------------------------------------------------------------

#: The keys docs/evaluation.md documents for finetune.json, and for each epoch's record.
RECORD_KEYS = {"top1", "top5", "best_top1", "done", "epochs_done", "step", "checkpoint", "feature_dim", "num_classes",
               "num_test", "time_s_this_start", "config", "epochs"}
EPOCH_KEYS = {"epoch", "train_loss", "lr", "top1", "top5"}


@pytest.mark.parametrize("trunk", ["cnn", "vit"])
def test_finetuning_learns_and_writes_a_record_per_epoch(trunk: str, cnn_run: Path, vit_run: Path,
                                                        tmp_path: Path) -> None:
    run = {"cnn": cnn_run, "vit": vit_run}[trunk]
    out = tmp_path / "finetune.json"
    code, _, err = sslkit("finetune", f"checkpoint={run}", *FINETUNE, "eval.finetune.epochs=3",
                          "eval.finetune.blr=0.05" if trunk == "cnn" else "eval.finetune.blr=0.01", f"output={out}")
    assert code == 0, err
    result = json.loads(out.read_text())
    assert set(result) == RECORD_KEYS and [set(r) for r in result["epochs"]] == [EPOCH_KEYS] * 3
    assert [r["epoch"] for r in result["epochs"]] == [1, 2, 3] and result["done"] and result["step"] == 2
    losses = [r["train_loss"] for r in result["epochs"]]
    assert losses[-1] < losses[0] and result["top1"] == result["epochs"][-1]["top1"]
    assert result["top1"] >= 0.5, result["epochs"]  # 10 classes: chance is 0.1
    assert result["epochs"][-1]["lr"] == pytest.approx(1e-6)  # the cosine ends at min_lr
    cfg = result["config"]
    assert cfg["epochs"] == 3 and cfg["smoothing"] == 0.1 and cfg["weight_decay"] == 0.05 and cfg["seed"] == 0
    if trunk == "vit":
        assert cfg["layer_decay"] == 0.75 and cfg["drop_path"] == 0.1
        assert cfg["drop_path_per_block"] == pytest.approx([0.0, 0.1]) and cfg["vit_features"] == "pool"
        assert result["feature_dim"] == 192
    else:
        assert cfg["layer_decay"] == 1.0 and cfg["drop_path"] is None and cfg["vit_features"] is None
    assert (tmp_path / "finetune.state.pt").exists()


def test_layer_decay_on_a_cnn_is_refused(cnn_run: Path) -> None:
    code, _, err = sslkit("finetune", f"checkpoint={cnn_run}", "eval.finetune.layer_decay=0.75")
    assert code == 2 and "eval.finetune.layer_decay=0.75" in err and "layer_decay=1.0" in err
    assert "Traceback" not in err


def test_an_interrupted_finetuning_resumes_bit_identically(vit_run: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the second epoch (drop path on: the RNG matters), then the same command: it resumes after the
    first epoch and ends with the weights, optimizer state and records of an uninterrupted run, bit for bit. With a
    loader worker: its persistent iterator is made in the first epoch of each start, which must not shift the RNG."""
    args = ("finetune", f"checkpoint={vit_run}", *FINETUNE, "data.train.kwargs.num_samples=64",
            "data.test.kwargs={num_samples: 32}", "data.num_workers=1", "eval.finetune.epochs=2",
            "eval.finetune.blr=0.01")
    code, _, err = sslkit(*args, f"output={tmp_path / 'whole.json'}")
    assert code == 0, err

    calls = {"n": 0}
    real = FT.train_epoch

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(FT, "train_epoch", interrupted)
    code, _, err = sslkit(*args, f"output={tmp_path / 'cut.json'}")
    assert code == 130 and "resume" in err
    assert len(json.loads((tmp_path / "cut.json").read_text())["epochs"]) == 1
    monkeypatch.setattr(FT, "train_epoch", real)
    code, out, err = sslkit(*args, f"output={tmp_path / 'cut.json'}")
    assert code == 0 and "resuming from epoch 1" in out, err

    whole = torch.load(tmp_path / "whole.state.pt", weights_only=True)
    resumed = torch.load(tmp_path / "cut.state.pt", weights_only=True)
    assert resumed["records"] == whole["records"] and resumed["step"] == whole["step"] == 4

    def tensors(tree, path=""):
        if isinstance(tree, torch.Tensor):
            yield path, tree
        elif isinstance(tree, dict):
            for key, value in tree.items():
                yield from tensors(value, f"{path}.{key}")
        elif isinstance(tree, list | tuple):
            for i, value in enumerate(tree):
                yield from tensors(value, f"{path}[{i}]")

    ours = dict(tensors({k: resumed[k] for k in ("model", "optimizer", "rng")}))
    theirs = dict(tensors({k: whole[k] for k in ("model", "optimizer", "rng")}))
    assert ours.keys() == theirs.keys() and len(ours) > 30
    unequal = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not unequal, unequal
    assert not math.isnan(json.loads((tmp_path / "cut.json").read_text())["top1"])
