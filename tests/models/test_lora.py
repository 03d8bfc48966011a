"""LoRA through peft (issue 65 item 4): continued pretraining from released weights with rank-r adapters on the
trunk's attention, every weight of the trunk kept as released, the teachers following the adapters, and every tool
reading the adapters merged (the same features, plain names); the settings peft cannot take are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, run_main
from safetensors.torch import save_file

from sslkit.builder.model import build_model, build_model_as_trained
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.models.lora import LoraError, add_lora, has_lora, merge_lora
from sslkit.tools.pretrained import load_pretrained

pytest.importorskip("peft")

D3 = ["config=dinov3", *SMALL, *RECIPES["dinov3"], "model.trunk_kwargs.drop_path_rate=0.0"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def test_a_lora_run_keeps_the_released_weights_and_trains_the_adapters_and_heads(tmp_path: Path) -> None:
    torch.manual_seed(5)
    released = build_model(compose_config(D3), in_channels=3).trunk
    save_file({k: v.contiguous() for k, v in released.state_dict().items()}, tmp_path / "released.safetensors")
    out = tmp_path / "run"
    proc = run_main(*D3, *LORA, f"model.pretrained={tmp_path / 'released.safetensors'}", "optim.max_steps=3",
                    "optim.lr=0.05", "eval.knn.enabled=false", f"output_dir={out}")
    assert "model.lora: rank-4 adapters on 4 layers of the trunk (attn.qkv, attn.proj)" in proc.stdout + proc.stderr
    state = torch.load(next((out / "checkpoints").glob("checkpoint_*.pt")), map_location="cpu", weights_only=False)
    model = state["model"]
    for name, value in released.state_dict().items():  # every released tensor as it was, in every copy
        base = name.replace(".qkv.", ".qkv.base_layer.").replace(".proj.", ".proj.base_layer.") \
            if name.startswith("blocks.") and (".attn.qkv." in name or ".attn.proj." in name) else name
        for copy in ("trunk", "teacher_trunk", "gram_trunk"):
            assert torch.equal(model[f"{copy}.{base}"], value), (copy, base)
    moved = [k for k in model if k.startswith("trunk.") and "lora_B" in k and model[k].abs().max() > 0]
    assert len(moved) == 4  # B starts at zero: every adapter learned
    assert any("lora_B" in k and model[k].abs().max() > 0 for k in model if k.startswith("teacher_trunk."))
    # every tool reads the adapters merged: plain names, the function of the trained model
    pre = load_pretrained(str(out), ["machine.device=cpu"])
    assert not has_lora(pre.model) and "blocks.0.attn.qkv.weight" in pre.trunk.state_dict()
    trained = build_model_as_trained(pre.config, 3)
    trained.load_state_dict(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(pre.trunk(x), trained.trunk.eval()(x), rtol=0, atol=1e-5)


def test_merging_keeps_the_function_and_the_names_of_the_plain_network() -> None:
    torch.manual_seed(0)
    model = build_model(compose_config(D3), in_channels=3)
    plain = {k: v.clone() for k, v in model.trunk.state_dict().items()}
    assert add_lora(model, rank=2, alpha=4) == 4 and has_lora(model)
    trainable = {n for n, p in model.trunk.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the trunk frozen but its adapters
    with torch.no_grad():
        for name, p in model.trunk.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model.trunk.eval()(x)
        merge_lora(model)
        after = model.trunk(x)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    assert set(model.trunk.state_dict()) == set(plain) and not has_lora(model)


def test_lora_settings_that_cannot_run_are_named() -> None:
    with pytest.raises(ConfigError, match=r"'model.lora.rank' must be a whole number >= 0"):
        compose_config([*D3, "model.lora.rank=-1"])
    with pytest.raises(ConfigError, match=r"with distributed\.strategy=fsdp: LoRA's layers under FSDP2"):
        compose_config([*D3, *LORA, "distributed.strategy=fsdp"])
    model = build_model(compose_config(D3), in_channels=3)
    with pytest.raises(LoraError, match=r"targets=\['attn.qkvv'\] match no layer of the trunk"):
        add_lora(model, rank=2, targets=["attn.qkvv"])
