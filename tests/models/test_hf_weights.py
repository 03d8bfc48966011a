"""model.pretrained from Hugging Face transformers' DINOv2, DINOv2-with-registers and DINOv3 ViTs (issue 65 item 1):
models built offline from transformers' own config classes (random weights, ``save_pretrained``), read into sslkit's
trunks, give transformers' own forward (CLS, registers, patch tokens) to 1e-5, in the names transformers 4.x wrote
and those of transformers 5's modules, RGB and four channels; a tensor the backbone has no place for is named."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL
from safetensors.torch import load_file, save_file

from sslkit.builder.model import build_model
from sslkit.config.compose import compose_config
from sslkit.models.weights import WeightsError, load_backbone

transformers = pytest.importorskip("transformers")

#: sslkit trunks of the shapes of the transformers models below (192 wide, 2 blocks, 2 heads, 8 px patches, 32 px).
TRUNKS = {
    "dinov2": ["+model.trunk_kwargs.layer_scale_init=1.0"],
    "dinov2_with_registers": ["+model.trunk_kwargs.layer_scale_init=1.0", "+model.trunk_kwargs.reg_tokens=4"],
    "dinov3_vit": ["model.trunk=vit_small_patch16_dinov3", "+model.trunk_kwargs.depth=2",
                   "+model.trunk_kwargs.embed_dim=192", "+model.trunk_kwargs.qkv_bias=true"],
}


def _hf_model(kind: str, channels: int = 3) -> torch.nn.Module:
    """A transformers model of ``kind`` with random weights (LayerScale 0.5, so that it is not the identity)."""
    shape = {"hidden_size": 192, "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8, "image_size": 32,
             "num_channels": channels, "layerscale_value": 0.5}
    torch.manual_seed(3)
    if kind == "dinov2":
        model = transformers.Dinov2Model(transformers.Dinov2Config(**shape))
    elif kind == "dinov2_with_registers":
        model = transformers.Dinov2WithRegistersModel(
            transformers.Dinov2WithRegistersConfig(**shape, num_register_tokens=4))
    else:
        model = transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(**shape, intermediate_size=768,
                                                                          num_register_tokens=4))
    with torch.no_grad():  # biases and LayerScale away from their initial zeros / constants
        for name, p in model.named_parameters():
            if name.endswith(("bias", "lambda1", "register_tokens", "mask_token")):
                p.copy_(torch.randn_like(p) * 0.1 + (0.5 if "lambda1" in name else 0.0))
    return model.eval()


def _model(kind: str, channels: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], *TRUNKS[kind]]),
                       in_channels=channels)


def _same_tokens(model: torch.nn.Module, hf: torch.nn.Module, channels: int = 3) -> None:
    """The trunk's CLS, register and patch tokens (after the final norm) against transformers' last hidden state."""
    trunk = model.trunk.eval()
    x = torch.randn(2, channels, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = trunk.forward_tokens(x)
        want = hf(pixel_values=x).last_hidden_state
    registers = tokens.registers.shape[1]
    torch.testing.assert_close(tokens.cls, want[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(tokens.registers, want[:, 1:1 + registers], rtol=0, atol=1e-5)
    torch.testing.assert_close(tokens.patches, want[:, 1 + registers:], rtol=0, atol=1e-5)
    assert want.shape[1] == 1 + registers + 16 and registers == (0 if isinstance(hf, transformers.Dinov2Model) else 4)


@pytest.mark.parametrize("kind", list(TRUNKS))
@pytest.mark.parametrize("names", ["save_pretrained", "module_names"])
def test_a_transformers_checkpoint_loads_into_the_trunk_and_gives_transformers_features(
        kind: str, names: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``save_pretrained``'s folder (the names transformers 4.x wrote, which 5 still writes) and a safetensors file of
    transformers 5's module names beside its config.json: every tensor in its place, the teachers too."""
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf"
    if names == "module_names":  # model.state_dict() as transformers 5 names it: q_proj, o_proj, model.layer
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "hf" / "weights.safetensors")
        (tmp_path / "hf" / "model.safetensors").unlink()
        path = tmp_path / "hf" / "weights.safetensors"
        assert any("q_proj" in k for k in load_file(path))
    else:
        assert not any("q_proj" in k for k in load_file(path / "model.safetensors")) or kind == "dinov3_vit"
    model = _model(kind)
    with caplog.at_level(logging.INFO, logger="sslkit"):
        assert load_backbone(model, path) == []
    assert f"a transformers {kind} checkpoint" in caplog.text
    _same_tokens(model, hf)
    for copy in model.trunk_copies():
        assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), model.trunk.state_dict().values()))


def test_dinov3_biases_that_are_not_zero_need_a_trunk_with_biases(tmp_path: Path) -> None:
    """Meta's distilled DINOv3 files carry q / v biases of zeros, which a trunk without biases may drop (timm's
    converter does); biases that are not zero stop the load, naming the key that gives the trunk biases."""
    hf = _hf_model("dinov3_vit")
    hf.save_pretrained(tmp_path / "hf")
    no_bias = [a for a in TRUNKS["dinov3_vit"] if "qkv_bias" not in a]
    torch.manual_seed(0)
    model = build_model(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], *no_bias]), in_channels=3)
    with pytest.raises(WeightsError, match=r"q / v biases are not zero .* model\.trunk_kwargs\.qkv_bias=true"):
        load_backbone(model, tmp_path / "hf")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if re.search(r"attention\.[qv]_proj\.bias", name):
                p.zero_()
    hf.save_pretrained(tmp_path / "zero")
    assert load_backbone(model, tmp_path / "zero") == []
    _same_tokens(model, hf)


@pytest.mark.parametrize("kind", ["dinov2", "dinov3_vit"])
def test_a_four_channel_transformers_checkpoint_loads_for_four_channel_data(kind: str, tmp_path: Path) -> None:
    hf = _hf_model(kind, channels=4)
    hf.save_pretrained(tmp_path / "hf")
    model = _model(kind, channels=4)
    assert load_backbone(model, tmp_path / "hf") == []
    _same_tokens(model, hf, channels=4)


def test_a_classifier_loads_its_backbone_and_a_stray_tensor_is_named(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Dinov2ForImageClassification's file: the backbone under ``dinov2.``, its classifier named as left out. A
    tensor with no place in the backbone stops the load naming it (a conversion that drops tensors in silence is
    how a file loads 2 of 211 tensors); a folder without its weights names the file."""
    config = transformers.Dinov2Config(hidden_size=192, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
                                       image_size=32, num_labels=5)
    torch.manual_seed(3)
    classifier = transformers.Dinov2ForImageClassification(config).eval()
    classifier.save_pretrained(tmp_path / "cls")
    model = _model("dinov2")
    with caplog.at_level(logging.INFO, logger="sslkit"):
        assert load_backbone(model, tmp_path / "cls") == []
    assert "of a head left out: classifier.bias, classifier.weight" in caplog.text
    _same_tokens(model, classifier.dinov2)
    state = load_file(tmp_path / "cls" / "model.safetensors")
    save_file({**state, "dinov2.encoder.layer.0.adapter.weight": torch.zeros(4, 4)},
              tmp_path / "cls" / "model.safetensors")
    with pytest.raises(WeightsError, match=r"1 of the file's .*dinov2\.encoder\.layer\.0\.adapter\.weight"):
        load_backbone(_model("dinov2"), tmp_path / "cls")
    with caplog.at_level(logging.WARNING, logger="sslkit"):  # asked for: the rest loads, the stray one is said
        assert load_backbone(_model("dinov2"), tmp_path / "cls", partial=True) == []
    assert "are left out (model.pretrained_partial=true): dinov2.encoder.layer.0.adapter.weight" in caplog.text
    del state["dinov2.encoder.layer.1.attention.attention.key.weight"]  # a q / k / v left incomplete: named too
    save_file(state, tmp_path / "cls" / "model.safetensors")
    with pytest.raises(WeightsError, match=r"2 of the file's .*layer\.1\.attention\.attention\.query\.weight"):
        load_backbone(_model("dinov2"), tmp_path / "cls")
    (tmp_path / "cls" / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="without its weights"):
        load_backbone(_model("dinov2"), tmp_path / "cls")
    (tmp_path / "cls" / "model.safetensors.index.json").write_text("{not json")  # a sharded one, cut short
    with pytest.raises(WeightsError, match=r"its shard index model\.safetensors\.index\.json cannot be read"):
        load_backbone(_model("dinov2"), tmp_path / "cls")


def test_the_command_line_continues_from_a_transformers_folder(tmp_path: Path) -> None:
    """``model.pretrained=DIR`` (a folder save_pretrained wrote) passes the config check and trains from it."""
    from helpers import run_main

    _hf_model("dinov2").save_pretrained(tmp_path / "hf")
    out = tmp_path / "run"
    proc = run_main("config=dinov2", *SMALL, *RECIPES["dinov2"], *TRUNKS["dinov2"],
                    f"model.pretrained={tmp_path / 'hf'}", "optim.max_steps=1", "eval.knn.enabled=false",
                    f"output_dir={out}")
    assert "a transformers dinov2 checkpoint, 43 tensors read" in proc.stdout + proc.stderr
    assert (out / "checkpoints").is_dir()
    (tmp_path / "empty").mkdir()
    proc = run_main("config=dinov2", *SMALL, *RECIPES["dinov2"], f"model.pretrained={tmp_path / 'empty'}",
                    f"output_dir={tmp_path / 'none'}", check=False)
    assert proc.returncode == 2 and "is a folder without a config.json" in proc.stderr + proc.stdout


def test_a_transformers_folder_is_a_bench_backbone_and_a_distillation_teacher_by_itself(tmp_path: Path) -> None:
    """``sslkit bench backbones=[DIR]`` and ``distill.teacher=DIR`` build the trunk its config.json describes (no
    architecture to name) and read the weights into it; the bench's random twin is that architecture."""
    import json

    from helpers import run_main, run_sslkit

    _hf_model("dinov2_with_registers").save_pretrained(tmp_path / "hf")
    out = tmp_path / "bench"
    code, _, stderr = run_sslkit("bench", "data=synthetic", "data.train.kwargs.num_samples=40",
                                 "+data.test.kwargs.num_samples=20", "machine.device=cpu", "bench.num_workers=0",
                                 "bench.knn.ks=[5]", "bench.bootstrap=50", "data.image_size=32",
                                 f"backbones=[{tmp_path / 'hf'}, random]", "protocols=[knn]", f"output={out}",
                                 f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 0, stderr[-2000:]
    r = json.loads((out / "results.json").read_text())
    assert r["backbones"] == [str(tmp_path / "hf"), "random (vit_tiny)"]
    details = r["results"][str(tmp_path / "hf")]["backbone"]
    assert details["arch_kwargs"]["reg_tokens"] == 4 and details["arch_kwargs"]["layer_scale_init"] == 0.5
    run = tmp_path / "student"
    run_main("config=distill", *SMALL, f"distill.teacher={tmp_path / 'hf'}",
             "distill.students=[{trunk: small_cnn, trunk_kwargs: {width: 8}}]", "optim.max_steps=1",
             "eval.knn.enabled=false", f"output_dir={run}")
    assert (run / "checkpoints").is_dir()


@pytest.mark.parametrize("kind", list(TRUNKS))
def test_the_trunk_a_transformers_config_describes_gives_its_features(kind: str, tmp_path: Path) -> None:
    """hf_trunk: the sslkit trunk built from config.json alone (what bench and distill build) takes the weights
    and gives transformers' tokens; DINOv3's gated MLP (SwiGLU) too."""
    from sslkit.builder.common import trunk_kwargs
    from sslkit.models.hf_weights import hf_config, hf_trunk
    from sslkit.models.weights import load_trunk
    from sslkit.registry import TRUNKS as REGISTERED
    from sslkit.registry import get

    hf = _hf_model(kind)
    if kind == "dinov3_vit":  # the gated MLP of DINOv3's larger releases
        config = transformers.DINOv3ViTConfig(hidden_size=192, num_hidden_layers=2, num_attention_heads=2,
                                              patch_size=8, image_size=32, intermediate_size=512,
                                              num_register_tokens=4, layerscale_value=0.5, use_gated_mlp=True,
                                              hidden_act="silu")  # (the released gated configs' activation)
        torch.manual_seed(5)
        hf = transformers.DINOv3ViTModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    name, given = hf_trunk(hf_config(tmp_path / "hf"))
    builder = get(REGISTERED, name)
    trunk = builder(**trunk_kwargs(builder, given, 3, 32, 16))
    assert load_trunk(trunk, tmp_path / "hf") == []
    _same_tokens(type("M", (), {"trunk": trunk})(), hf)
    if kind == "dinov3_vit":  # an activation timm's MLP has not: refused, not approximated
        with pytest.raises(ValueError, match="a gated MLP of gelu"):
            hf_trunk({**hf_config(tmp_path / "hf"), "hidden_act": "gelu"})


def test_a_sharded_transformers_checkpoint_loads_from_its_index(tmp_path: Path) -> None:
    """A checkpoint save_pretrained wrote in shards (``model.safetensors.index.json`` naming them): all read."""
    hf = _hf_model("dinov2")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    model = _model("dinov2")
    assert load_backbone(model, tmp_path / "hf") == []
    _same_tokens(model, hf)
