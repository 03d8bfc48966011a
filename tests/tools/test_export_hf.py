"""``sslkit export format=hf`` (issue 65 item 2): a ViT run's trunk as a transformers folder that
``transformers.AutoModel.from_pretrained`` reads with no missing or unexpected key and whose tokens equal the trunk's
to 1e-5, checked here through transformers itself; read back by ``model.pretrained`` it is the same trunk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, run_main, run_sslkit

from sslkit.builder.model import build_model
from sslkit.config.compose import compose_config
from sslkit.models.weights import load_backbone
from sslkit.tools.pretrained import load_pretrained

transformers = pytest.importorskip("transformers")

#: The runs exported: sslkit's ViT with registers and LayerScale (-> Dinov2WithRegistersModel), without either
#: (-> Dinov2Model, LayerScale 1), the DINOv3 trunk with q / v biases and a gated MLP (-> DINOv3ViTModel).
RUNS = {
    "vit_registers": (["+model.trunk_kwargs.reg_tokens=4", "+model.trunk_kwargs.layer_scale_init=0.5"],
                      "Dinov2WithRegistersModel"),
    "vit_plain": ([], "Dinov2Model"),
    "dinov3_gated": (["model.trunk=vit_small_patch16_dinov3", "+model.trunk_kwargs.depth=2",
                      "+model.trunk_kwargs.qkv_bias=true", "+model.trunk_kwargs.swiglu_mlp=true",
                      "+model.trunk_kwargs.swiglu_align_to=8"], "DINOv3ViTModel"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_an_exported_vit_is_read_whole_by_transformers_and_gives_the_trunks_tokens(name: str, tmp_path: Path) -> None:
    extra, cls = RUNS[name]
    run = tmp_path / "run"
    run_main("config=dinov2", *SMALL, *RECIPES["dinov2"], *extra, "optim.max_steps=1", "eval.knn.enabled=false",
             f"output_dir={run}")
    code, _, stderr = run_sslkit("export", f"checkpoint={run}", "format=hf", "machine.device=cpu")
    assert code == 0, stderr[-2000:]
    folder = run / "export" / "hf"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    sidecar = json.loads((run / "export" / "hf.json").read_text())
    assert sidecar["format"] == "hf" and sidecar["hf"]["class"] == cls
    model, info = transformers.AutoModel.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == cls
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trunk = load_pretrained(str(run), ["machine.device=cpu"]).trunk.eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        tokens = trunk.forward_tokens(x)
        theirs = model.eval()(pixel_values=x).last_hidden_state
    ours = torch.cat([tokens.cls[:, None], tokens.registers, tokens.patches], dim=1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # and back: the folder as model.pretrained gives the same tokens
    fresh = build_model(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], *extra]), in_channels=3)
    load_backbone(fresh, folder)
    with torch.no_grad():
        again = fresh.trunk.eval().forward_tokens(x)
    torch.testing.assert_close(torch.cat([again.cls[:, None], again.registers, again.patches], dim=1), ours,
                               rtol=0, atol=1e-5)


def test_a_cnn_is_no_transformers_dinov2(tmp_path: Path) -> None:
    run = tmp_path / "cnn"
    run_main("config=simclr", *SMALL, "optim.max_steps=1", "eval.knn.enabled=false", f"output_dir={run}")
    code, _, stderr = run_sslkit("export", f"checkpoint={run}", "format=hf", "machine.device=cpu")
    assert code == 2 and "format=hf writes sslkit's ViTs" in stderr and "Traceback" not in stderr
    code, _, stderr = run_sslkit("export", f"checkpoint={run}", "format=hf", f"output={tmp_path / 'x.onnx'}")
    assert code == 2 and "format=hf writes a folder" in stderr
