"""ViTs in the evaluations: the features eval.vit_features names (kNN, linear, extract), the timm export, and the
evaluation package's place below the command line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from helpers import RECIPES, REPO, SMALL, metrics, run_main, run_sslkit
from safetensors.torch import load_file

from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.evaluation import FeatureEncoder, weighted_knn
from sslkit.models.trunks import SmallCNN
from sslkit.models.vit import build_vit
from sslkit.tools.export import _twin, export_vit
from sslkit.tools.pretrained import ToolError, load_pretrained

#: A tiny ViT run: 2 blocks of 192-d tokens, 4 x 4 patches of the synthetic 32 px images, 64 train and 64 test images.
TINY_VIT = [*SMALL, *RECIPES["simclr_vit"], "optim.max_steps=2", "log.tensorboard=false",
            "data.test.kwargs={num_samples: 64}"]


sslkit = run_sslkit  # the sslkit command in this process


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny SimCLR ViT run whose end-of-training kNN read the mean patch token (eval.vit_features=avg)."""
    out = tmp_path_factory.mktemp("vit_eval") / "simclr_vit"
    run_main("config=simclr_vit", *TINY_VIT, "eval.vit_features=avg", f"output_dir={out}")
    return out


def _by_hand(trunk: torch.nn.Module, x: torch.Tensor, kind: str, last_n: int) -> torch.Tensor:
    """The features of ``kind`` from timm's own token outputs (forward_features, forward_intermediates)."""
    tokens = trunk.forward_features(x)  # [B, 1 + R + N, D] after the final norm
    prefix = 1 + trunk.num_reg_tokens
    cls, avg = tokens[:, 0], tokens[:, prefix:].mean(dim=1)
    if kind == "cls_last_n":
        blocks = trunk.forward_intermediates(x, indices=last_n, norm=True, return_prefix_tokens=True,
                                             output_fmt="NLC", intermediates_only=True)
        return torch.cat([prefix_tokens[:, 0] for _, prefix_tokens in blocks], dim=1)  # oldest block first
    return {"pool": cls if trunk.pool_kind == "cls" else avg, "cls": cls, "avg": avg,
            "cls+avg": torch.cat([cls, avg], dim=1)}[kind]


@pytest.mark.parametrize("pool", ["cls", "avg"])
def test_every_feature_kind_is_what_timms_tokens_give(pool: str) -> None:
    """Every eval.vit_features kind, on a ViT with a register token (so the patch tokens start at 2), at the trunk's
    size and at another multiple of the patch size, with the dimension it says."""
    torch.manual_seed(0)
    trunk = build_vit("vit_tiny", 3, img_size=32, patch_size=8, depth=3, num_heads=2, reg_tokens=1, pool=pool).eval()
    widths = {"pool": 192, "cls": 192, "avg": 192, "cls+avg": 384, "cls_last_n": 2 * 192}
    for side in (32, 48):
        x = torch.randn(3, 3, side, side)
        for kind, width in widths.items():
            encoder = FeatureEncoder(trunk, kind, last_n=2)
            with torch.no_grad():
                got, expected = encoder(x), _by_hand(trunk, x, kind, 2)
            assert got.shape == (3, width) and encoder.out_dim == width, kind
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=kind)
    assert FeatureEncoder(trunk, "cls_last_n", 2).describe() == {"vit_features": "cls_last_n", "vit_last_n": 2}
    with pytest.raises(ValueError, match=r"last_n must be in \[1, 3\]"):
        FeatureEncoder(trunk, "cls_last_n", 4)


def test_a_cnn_has_only_its_own_features() -> None:
    with pytest.raises(ConfigError, match=r"eval\.vit_features"):
        compose_config(["config=simclr", "machine.device=cpu", "eval.vit_features=cls"])
    with pytest.raises(ValueError, match="only pool"):
        FeatureEncoder(SmallCNN(3, width=8), "cls")
    encoder = FeatureEncoder(SmallCNN(3, width=8))
    assert encoder.describe() == {"vit_features": None, "vit_last_n": None}


def _eval_set(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's evaluation images of ``split`` through the eval transform, and their labels, by hand."""
    from sslkit.data import build_source, build_transform

    source = build_source("synthetic", split, None, num_samples=64)
    transform = build_transform("eval", image_size=32)
    return (torch.stack([transform(source[i][0])[0] for i in range(64)]),
            torch.tensor([source[i][1] for i in range(64)]))


def test_knn_at_the_end_of_training_and_the_tool_read_the_configured_features(vit_run: Path) -> None:
    """The run's kNN (eval.vit_features=avg) is the weighted kNN of the mean patch tokens computed by hand, and the
    knn tool gives the same number and records the kind; eval.vit_features=cls is another number, also by hand."""
    trained = [r for r in metrics(vit_run) if "knn_top1" in r][-1]
    pre = load_pretrained(str(vit_run), ["machine.device=cpu"])
    (train_x, train_y), (test_x, test_y) = _eval_set("train"), _eval_set("test")
    with torch.no_grad():
        by_hand = {kind: [_by_hand(pre.trunk, x, kind, 2) for x in (train_x, test_x)] for kind in ("avg", "cls")}
    expected = {kind: weighted_knn(f[0], train_y, f[1], test_y, 10, k=5)["knn_top1"] for kind, f in by_hand.items()}
    assert expected["avg"] != expected["cls"]  # so the figures below say which features were read
    assert trained["knn_top1"] == pytest.approx(expected["avg"], abs=1e-9)

    code, _, err = sslkit("knn", f"checkpoint={vit_run}")
    assert code == 0, err
    record = json.loads((vit_run / "eval" / "knn.json").read_text())
    assert record["top1"] == pytest.approx(expected["avg"], abs=1e-9)
    assert (record["vit_features"], record["vit_last_n"], record["feature_dim"]) == ("avg", None, 192)
    code, _, err = sslkit("knn", f"checkpoint={vit_run}", "eval.vit_features=cls", f"output={vit_run / 'cls.json'}")
    assert code == 0, err
    record = json.loads((vit_run / "cls.json").read_text())
    assert record["vit_features"] == "cls" and record["top1"] == pytest.approx(expected["cls"], abs=1e-9)


def test_extract_and_linear_read_the_last_blocks_cls_tokens(vit_run: Path, tmp_path: Path) -> None:
    """DINO's features (the CLS tokens of the last n blocks): extract writes them and says so; the linear probe
    trains on them and records them (its settings key, so other features start afresh)."""
    dino = ("eval.vit_features=cls_last_n", "eval.vit_last_n=2")
    code, _, err = sslkit("extract", f"checkpoint={vit_run}", *dino, f"output={tmp_path / 'f.npz'}")
    assert code == 0, err
    got = np.load(tmp_path / "f.npz")
    assert got["features"].shape == (64, 2 * 192)
    meta = json.loads(str(got["meta"]))
    assert (meta["vit_features"], meta["vit_last_n"]) == ("cls_last_n", 2)
    pre = load_pretrained(str(vit_run), ["machine.device=cpu"])
    test_x, _ = _eval_set("test")
    with torch.no_grad():
        expected = _by_hand(pre.trunk, test_x[:8], "cls_last_n", 2)
    np.testing.assert_allclose(got["features"][:8], expected.numpy(), rtol=0, atol=1e-5)

    code, _, err = sslkit("linear", f"checkpoint={vit_run}", *dino, "eval.linear.epochs=1", "eval.linear.batch_size=32",
                          f"output={tmp_path / 'linear.json'}")
    assert code == 0, err
    record = json.loads((tmp_path / "linear.json").read_text())
    assert record["feature_dim"] == 384 and record["config"]["vit_features"] == "cls_last_n"
    assert record["config"]["vit_last_n"] == 2

    code, _, err = sslkit("knn", f"checkpoint={vit_run}", "eval.vit_features=cls_last_n", "eval.vit_last_n=3")
    assert code == 2 and "'eval.vit_last_n' = 3: the ViT has 2 blocks" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# Export for timm
# ---------------------------------------------------------------------------------------------


def test_vit_export_loads_into_timm_alone_with_the_same_features(vit_run: Path, tmp_path: Path) -> None:
    """encoder.json's architecture and kwargs and the safetensors file are all it takes: timm.create_model and
    load_file, strict=True, the same features at the training size and at another multiple of the patch size."""
    out = tmp_path / "encoder.safetensors"
    code, _, err = sslkit("export", f"checkpoint={vit_run}", f"output={out}")  # twin=auto: timm for a ViT
    assert code == 0, err
    meta = json.loads((tmp_path / "encoder.json").read_text())
    model = timm.create_model(meta["timm_arch"], num_classes=0, **meta["timm_kwargs"])
    model.load_state_dict(load_file(str(out)), strict=True)
    model.eval()
    assert meta["architecture"] == "timm vit_tiny_patch16_224" and "timm.create_model(" in meta["load"]
    assert meta["feature_dim"] == 192 and meta["left_out"] is None and meta["input"]["image_size"] == 32
    pre = load_pretrained(str(vit_run), ["machine.device=cpu"])
    for side in (32, 56):
        x = torch.rand(2, 3, side, side)
        with torch.no_grad():
            torch.testing.assert_close(model(x), pre.trunk(x), rtol=0, atol=1e-5)


def test_the_mask_token_is_left_out_with_a_note() -> None:
    trunk = build_vit("vit_tiny", 3, img_size=16, patch_size=8, depth=1, num_heads=2)
    trunk.enable_mask_token()
    state, arch, kwargs, left_out = export_vit(trunk)
    assert "mask_token" not in state and "mask token" in left_out["mask_token"]
    timm.create_model(arch, num_classes=0, **kwargs).load_state_dict(state, strict=True)


def test_a_twin_the_trunk_does_not_have_is_refused_with_what_to_do(vit_run: Path, tmp_path: Path) -> None:
    code, _, err = sslkit("export", f"checkpoint={vit_run}", "twin=torchvision", f"output={tmp_path / 'e.pt'}")
    assert code == 2 and "is a ViT" in err and "twin=timm" in err and not (tmp_path / "e.pt").exists()
    cfg = compose_config(["config=simclr", "machine.device=cpu"])
    with pytest.raises(ToolError, match="twin=torchvision"):
        _twin("timm", SmallCNN(3, width=8), cfg, 3)
    code, _, err = sslkit("export", f"checkpoint={vit_run}", "twin=onnx")
    assert code == 2 and "twin=auto, twin=torchvision, twin=timm, twin=none" in err


# ---------------------------------------------------------------------------------------------
# The import structure
# ---------------------------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    """Every sslkit module ``path`` imports, at any depth of its code (imports inside functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sslkit"):
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sslkit")}
    return found


def test_the_tools_do_not_reach_the_command_line() -> None:
    """No module that the tools after training (sslkit.tools, which use sslkit.evaluation's protocols) import,
    directly or through others, at any depth of their code, is sslkit.launch.cli: the command line dispatches to the
    tools, never the other way round (the shared helpers are in sslkit.console, which the command line uses
    too)."""
    package = REPO / "sslkit"
    files = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    reached, todo = set(), [m for m in files if m.startswith("sslkit.tools")]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo += [m for m in _imports(files[module]) if m in files]
    assert "sslkit.evaluation.knn" in reached and "sslkit.console" in reached
    assert "sslkit.launch.cli" not in reached

    # one owner of the log's set-up, which the training command uses too
    assert "def setup_logging" not in (package / "launch" / "cli.py").read_text()
    assert "from sslkit.console import setup_logging" in (package / "launch" / "cli.py").read_text()
