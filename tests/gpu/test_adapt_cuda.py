"""Continued pretraining's tools on CUDA under bf16 autocast (issue 65 item 4; never run on a GPU when written): LoRA
through peft and the anchor to the starting model train a DINOv3 run from a released file, the released tensors
stay as they were and the anchor starts at zero."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, metrics, run_main
from safetensors.torch import save_file

from sslkit.builder.model import build_model
from sslkit.config.compose import compose_config

pytestmark = [pytest.mark.gpu]

GPU = ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16"]
D3 = ["config=dinov3", *SMALL, *RECIPES["dinov3"], "model.trunk_kwargs.drop_path_rate=0.0"]


def test_lora_and_the_anchor_train_on_cuda_and_keep_the_released_weights(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    torch.manual_seed(5)
    released = build_model(compose_config(D3), in_channels=3).trunk
    save_file({k: v.contiguous() for k, v in released.state_dict().items()}, tmp_path / "released.safetensors")
    out = tmp_path / "run"
    run_main(*D3, *GPU, "model.lora.rank=4", "model.kwargs.anchor=true", "+loss.anchor_weight=1.0",
             f"model.pretrained={tmp_path / 'released.safetensors'}", "optim.max_steps=3", "log.every_n_steps=1",
             "eval.knn.enabled=false", f"output_dir={out}")
    lines = [r for r in metrics(out) if "loss" in r and r.get("phase") != "eval"]
    assert len(lines) == 3 and all(math.isfinite(r["loss"]) for r in lines)
    assert lines[0]["anchor_loss"] < 1e-3  # bf16: the student is the start up to rounding
    state = torch.load(next((out / "checkpoints").glob("checkpoint_*.pt")), map_location="cpu", weights_only=False)
    kept = state["model"]["trunk.blocks.0.attn.qkv.base_layer.weight"]
    assert torch.equal(kept, released.state_dict()["blocks.0.attn.qkv.weight"])
