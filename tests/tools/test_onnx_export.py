"""``sslkit export format=onnx``: the trunk as an ONNX graph with a dynamic batch axis, checked with onnxruntime
against PyTorch before it is written; its errors, and a failed check that writes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import RECIPES, SMALL, run_main, run_sslkit

from sslkit.tools import export as E
from sslkit.tools.pretrained import load_pretrained

TINY = [*SMALL, "optim.max_steps=2", "log.tensorboard=false", "eval.knn.enabled=false"]

sslkit = run_sslkit  # the sslkit command in this process


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SimCLR run with sslkit's small CNN (width 8, synthetic 3x32x32 images, 2 steps)."""
    out = tmp_path_factory.mktemp("onnx") / "cnn"
    run_main("config=simclr", *TINY, f"output_dir={out}")
    return out


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with a torchvision ResNet-18 trunk (ImageNet stem, 1 step)."""
    out = tmp_path_factory.mktemp("onnx") / "resnet"
    run_main("config=simclr", *TINY, "model.trunk=resnet18", "model.trunk_kwargs={}", "optim.max_steps=1",
             f"output_dir={out}")
    return out


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SimCLR ViT run (2 blocks of 192-d tokens, 8 px patches of 32 px images, 2 steps)."""
    out = tmp_path_factory.mktemp("onnx") / "vit"
    run_main("config=simclr_vit", *TINY, *RECIPES["simclr_vit"], f"output_dir={out}")
    return out


def _onnx_features(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["features"], {"pixels": x.numpy()})[0]


def _assert_same_features(path: Path, run: Path, batches: tuple[int, ...] = (1, 3, 7)) -> None:
    """onnxruntime on ``path`` gives the features of the checkpoint's trunk, rebuilt independently in PyTorch, for
    every batch size in ``batches`` (the dynamic axis), within the export's tolerance."""
    trunk = load_pretrained(str(run), ["machine.device=cpu"]).trunk
    g = torch.Generator().manual_seed(3)
    for n in batches:
        x = torch.randn(n, 3, 32, 32, generator=g)
        with torch.no_grad():
            want = trunk(x).numpy()
        got = _onnx_features(path, x)
        assert got.shape == want.shape == (n, trunk.out_dim)
        np.testing.assert_allclose(got, want, atol=E.ONNX_ATOL, rtol=E.ONNX_RTOL)


@pytest.mark.parametrize("which, architecture, dim", [
    ("cnn_run", "sslkit trunk small_cnn", 8 * 8 * 16),
    ("resnet_run", "torchvision.models.resnet18", 512),
    ("vit_run", "timm vit_tiny_patch16_224", 192),
])
def test_onnx_export_gives_the_trunks_features_at_any_batch_size(which: str, architecture: str, dim: int,
                                                                  request: pytest.FixtureRequest) -> None:
    run: Path = request.getfixturevalue(which)
    code, _, err = sslkit("export", f"checkpoint={run}", "format=onnx")
    assert code == 0, err
    out = run / "export" / "encoder.onnx"
    assert sorted(p.name for p in out.parent.iterdir()) == ["encoder.json", "encoder.onnx"]  # no temp file left
    _assert_same_features(out, run)
    batch = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param == "batch" and not batch.HasField("dim_value")
    assert isinstance(ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_inputs()[0].shape[0], str)
    meta = json.loads((run / "export" / "encoder.json").read_text())
    assert meta["format"] == "onnx" and meta["architecture"] == architecture and meta["feature_dim"] == dim
    assert meta["input"]["mean"] == [0.5] * 3 and meta["input"]["std"] == [0.5] * 3
    assert meta["input"]["image_size"] == 32 and meta["method"] == "simclr" and meta["features"] == "trunk"
    entry = meta["onnx"]
    assert entry["input"] == {"name": "pixels", "shape": ["batch", 3, 32, 32], "dtype": "float32"}
    assert entry["output"] == {"name": "features", "shape": ["batch", dim], "dtype": "float32"}
    assert entry["opset"] >= 17 and entry["exporter"] == "torch.onnx.export (dynamo)"
    assert entry["tolerance"]["atol"] == E.ONNX_ATOL and entry["tolerance"]["rtol"] == E.ONNX_RTOL
    measured = entry["checked"]["max_abs_difference"]
    assert set(measured) == {"1", "5"} and all(0 <= d < E.ONNX_ATOL for d in measured.values())
    assert entry["onnxruntime"] == ort.__version__ and entry["torch"] == torch.__version__
    assert "InferenceSession('encoder.onnx'" in entry["load"] and "run(['features'], {'pixels': x})" in entry["load"]
    assert entry["external_data"] is None and "fixed at 32x32" in entry["dynamic_axes"]


@pytest.mark.parametrize("args, words", [
    (("format=onxx",), ["format=onxx", "Did you mean 'onnx'"]),
    (("format=onnx", "output={tmp}/x.safetensors"), ["format=onnx", "x.safetensors", ".onnx"]),
    (("format=pt", "output={tmp}/x.onnx"), ["format=pt", "x.onnx"]),
    (("format=onnx", "output={tmp}/x.bin"), ["output=", "x.bin", ".onnx"]),
    (("format=onnx", "twin=torchvision"), ["twin=torchvision", "does not apply to format=onnx"]),
    (("output={tmp}/x.onnx", "twin=timm"), ["twin=timm", "does not apply to format=onnx"]),
])
def test_onnx_argument_errors_are_messages_and_write_nothing(cnn_run: Path, tmp_path: Path, args: tuple[str, ...],
                                                             words: list[str]) -> None:
    before = sorted(cnn_run.rglob("*"))
    args = tuple(a.format(tmp=tmp_path) for a in args)
    output = () if any(a.startswith("output=") for a in args) else (f"output={tmp_path / 'e.onnx'}",)
    code, _, err = sslkit("export", f"checkpoint={cnn_run}", *args, *output)
    assert code == 2 and "Traceback" not in err and err.startswith("sslkit export: error:"), err
    assert all(w in err for w in words), err
    assert list(tmp_path.iterdir()) == [] and sorted(cnn_run.rglob("*")) == before


@pytest.mark.parametrize("module", ["onnxruntime", "onnx", "onnxscript"])
def test_a_missing_onnx_module_says_what_to_install(cnn_run: Path, tmp_path: Path, module: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as when it is not installed
    code, _, err = sslkit("export", f"checkpoint={cnn_run}", "format=onnx", f"output={tmp_path / 'e.onnx'}")
    assert code == 2 and "Traceback" not in err
    assert f"'{module}'" in err and "pip install 'sslkit[onnx]'" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_check_writes_nothing(vit_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime's features off by 0.01: refused with the difference, no temp file, no graph, no sidecar."""
    run = ort.InferenceSession.run

    def off(self, names, feed, *args, **kwargs):
        return [y + np.float32(0.01) for y in run(self, names, feed, *args, **kwargs)]

    monkeypatch.setattr(ort.InferenceSession, "run", off)
    code, _, err = sslkit("export", f"checkpoint={vit_run}", "format=onnx", f"output={tmp_path / 'e.onnx'}")
    assert code == 2 and "Traceback" not in err
    assert "max abs difference 0.01" in err and "please report this as a bug" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_the_torchscript_exporter_when_dynamo_fails_and_weights_in_a_data_file(
        exporter: str, cnn_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dynamo exporter failing: the TorchScript one, checked the same way. Weights above the single-file size go
    to ``<file>.data``, which a later single-file export to the same path removes."""
    export = torch.onnx.export

    def no_dynamo(*args, dynamo: bool = True, **kwargs):
        if dynamo:
            raise RuntimeError("torch.export cannot trace this")
        return export(*args, dynamo=False, **kwargs)

    out = tmp_path / "e.onnx"
    with monkeypatch.context() as m:
        if exporter == "torchscript":
            m.setattr(torch.onnx, "export", no_dynamo)
        m.setattr(E, "_ONNX_SINGLE_FILE_BYTES", 0)
        code, _, err = sslkit("export", f"checkpoint={cnn_run}", f"output={out}")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "e.onnx", "e.onnx.data"]
    meta = json.loads((tmp_path / "e.json").read_text())
    assert meta["onnx"]["exporter"] == f"torch.onnx.export ({exporter})"
    assert meta["onnx"]["external_data"] == "e.onnx.data"
    _assert_same_features(out, cnn_run, (1, 7))
    batch = onnx.load(str(out), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.HasField("dim_value")
    code, _, err = sslkit("export", f"checkpoint={cnn_run}", f"output={out}")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "e.onnx"]
    _assert_same_features(out, cnn_run, (3,))


def test_format_from_the_extension_and_in_the_usage(cnn_run: Path, tmp_path: Path) -> None:
    code, _, err = sslkit("export", f"checkpoint={cnn_run}", "twin=none", "format=pt", f"output={tmp_path / 'e.pth'}")
    assert code == 0, err
    assert "features.0.weight" in torch.load(tmp_path / "e.pth", weights_only=True)
    assert json.loads((tmp_path / "e.json").read_text())["format"] == "pt"
    code, out, _ = sslkit("export", "--help")
    assert code == 0 and "format=...  safetensors | pt" in out and "onnx" in out
