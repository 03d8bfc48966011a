"""Optimisation for ViTs: no weight decay on embeddings and tokens, layer-wise lr decay, gradient clipping, freezing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import SMALL, VIT, per_sample_task, run_main
from torch import nn

from sslkit.builder import build_task
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.models.vit import build_vit
from sslkit.optim import build_optimizer, param_groups, set_lr
from sslkit.train_steps.standard import standard_train_step


class _Model(nn.Module):
    """A ViT trunk with registers, LayerScale and a mask token, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = build_vit("vit_tiny", 1, 28, 7, depth=3, num_heads=3, reg_tokens=1, layer_scale_init=1e-5)
        self.trunk.enable_mask_token()
        self.head = nn.Sequential(nn.Linear(192, 8), nn.LayerNorm(8))


def _layer(name: str, depth: int = 3) -> int:
    """The BEiT / MAE layer rule, written out for the test: embedding 0, block i i + 1, the rest depth + 1."""
    if not name.startswith("trunk."):
        return depth + 1
    rest = name[len("trunk."):]
    if re.match(r"(cls_token|reg_token|pos_embed|mask_token|patch_embed\.)", rest):
        return 0
    match = re.match(r"blocks\.(\d+)\.", rest)
    return int(match.group(1)) + 1 if match else depth + 1


def test_no_weight_decay_on_biases_norms_gammas_embeddings_and_tokens() -> None:
    model = _Model()
    groups = param_groups(model, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    expected = {n for n, p in model.named_parameters() if p.ndim <= 1 or n.split(".")[-1] in
                ("pos_embed", "cls_token", "reg_token", "mask_token")}
    assert no_decay == expected
    assert {"trunk.pos_embed", "trunk.cls_token", "trunk.reg_token", "trunk.mask_token",
            "trunk.blocks.0.ls1.gamma", "trunk.blocks.2.norm2.weight", "head.0.bias"} <= no_decay
    assert "trunk.blocks.0.attn.qkv.weight" not in no_decay and "trunk.patch_embed.proj.weight" not in no_decay


@pytest.mark.parametrize(("decay", "mult"), [(0.65, 1.0), (0.75, 0.2)])
def test_layer_decay_and_patch_embedding_multiplier_scale_each_parameters_lr(decay: float, mult: float) -> None:
    model = _Model()
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=decay, patch_embed_lr_mult=mult)
    set_lr(optimizer, 2e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            expected = decay ** (4 - _layer(name)) * (mult if ".patch_embed." in name else 1.0)  # num_layers = 4
            assert group["lr"] == pytest.approx(2e-3 * expected), name
            seen += 1
    assert seen == sum(1 for p in model.parameters() if p.requires_grad)
    assert decay ** 4 * mult == pytest.approx(min(g["lr_scale"] for g in optimizer.param_groups))


@pytest.mark.parametrize(("decay", "mult", "trunk"), [(1.0, 1.0, 0.25), (0.75, 0.2, 0.0625)])
def test_the_trunk_multiplier_scales_every_backbone_parameter_and_no_head(decay: float, mult: float,
                                                                          trunk: float) -> None:
    """optim.trunk_lr_mult: fresh heads at the full rate on a slower trunk, on top of layer decay (the trunk's own
    top layer, its final norm, too), for a ViT, a CNN and a distillation's students.<i>.trunk."""
    model = _Model()
    optimizer = build_optimizer(model, "adamw", lr=1e-3, layer_decay=decay, patch_embed_lr_mult=mult,
                                trunk_lr_mult=trunk)
    set_lr(optimizer, 2e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            expected = (decay ** (4 - _layer(name)) * (mult if ".patch_embed." in name else 1.0)
                        * (trunk if name.startswith("trunk.") else 1.0))
            assert group["lr"] == pytest.approx(2e-3 * expected), name
    lr = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lr["trunk.norm.weight"] == pytest.approx(2e-3 * trunk) and lr["head.0.weight"] == pytest.approx(2e-3)

    students = nn.Module()
    students.students = nn.ModuleList([nn.Module()])
    students.students[0].trunk = nn.Conv2d(1, 4, 3)
    students.students[0].head = nn.Linear(4, 2)
    optimizer = build_optimizer(students, "sgd", lr=0.1, trunk_lr_mult=trunk)
    lr = {n: g["lr"] for g in optimizer.param_groups for p in g["params"]
          for n, q in students.named_parameters() if q is p}
    assert lr == {"students.0.trunk.weight": pytest.approx(0.1 * trunk),
                  "students.0.trunk.bias": pytest.approx(0.1 * trunk),
                  "students.0.head.weight": pytest.approx(0.1), "students.0.head.bias": pytest.approx(0.1)}


def test_the_trunk_multiplier_reaches_a_cnn_runs_optimizer_and_is_checked() -> None:
    task = build_task(compose_config(["config=simclr", *SMALL, "optim.trunk_lr_mult=0.5", "optim.max_steps=1"]))
    try:
        lr = {n: g["lr"] for g in task.optimizer.param_groups for p in g["params"]
              for n, q in task.base_model.named_parameters() if q is p}
        trunk = {v for n, v in lr.items() if n.startswith("trunk.")}
        heads = {v for n, v in lr.items() if not n.startswith("trunk.")}
        assert len(trunk) == len(heads) == 1 and trunk.pop() == pytest.approx(0.5 * heads.pop())
    finally:
        task.close()
    with pytest.raises(ConfigError, match=r"'optim.trunk_lr_mult' must be > 0"):
        compose_config(["config=simclr", "machine.device=cpu", "optim.trunk_lr_mult=0"])


def test_layer_decay_on_a_cnn_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'optim.layer_decay' = 0.75 needs a ViT's layers"):
        compose_config(["config=simclr", "machine.device=cpu", "optim.layer_decay=0.75"])
    with pytest.raises(ValueError, match="need a trunk with layers"):
        build_optimizer(nn.Linear(3, 3), "adamw", lr=0.1, layer_decay=0.5)


# ------------------------------------------------------------------------------------------------- clipping
def _delta(task) -> list[torch.Tensor]:
    before = [p.detach().clone() for p in task.base_model.parameters()]
    task.start_phase()
    standard_train_step(task)
    return [p.detach() - b for p, b in zip(task.base_model.parameters(), before)]


def _task(clip: float = 0.0, mode: str = "global", accumulate: int = 1, fp16: bool = False):
    task = per_sample_task(steps=1, accumulate=accumulate)
    task.optimizer.param_groups[0]["momentum"] = 0.0  # SGD: the update is -lr * gradient
    task.clip_grad, task.clip_grad_mode = clip, mode
    if fp16:
        # a small scale: the default 65536 overflows this model's float16 gradients and the scaler skips the step
        task.amp_dtype, task.scaler = torch.float16, torch.amp.GradScaler("cpu", init_scale=16.0)
    return task


@pytest.mark.parametrize("fp16", [False, True])
def test_global_clipping_scales_the_update_and_logs_the_norm_before(fp16: bool) -> None:
    free = _delta(_task(fp16=fp16))
    norm = torch.sqrt(sum((d / 0.1).pow(2).sum() for d in free))  # the gradient's norm, from the unclipped update
    clipped_task = _task(clip=0.5 * norm.item(), fp16=fp16)
    clipped = _delta(clipped_task)
    # under float16 the gradients are unscaled first: clipping the scaled ones (x 16) would shrink them 16x more
    assert clipped_task.last_batch.metrics["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-4)
    for a, b in zip(free, clipped):
        assert torch.allclose(b, 0.5 * a, rtol=1e-4, atol=1e-8)
    untouched = _delta(_task(clip=10 * norm.item(), fp16=fp16))  # below the threshold: no change
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-9) for a, b in zip(free, untouched))


def test_per_parameter_clipping_is_dinos() -> None:
    free = _delta(_task())
    clip = 0.5 * min((d / 0.1).norm().item() for d in free)
    clipped = _delta(_task(clip=clip, mode="per_parameter"))
    for a, b in zip(free, clipped):
        g = (a / 0.1).norm()
        assert torch.allclose(b, a * min(1.0, clip / (g.item() + 1e-6)), rtol=1e-4, atol=1e-9)


def test_clipping_comes_after_accumulation() -> None:
    """K micro-batches then one clip equals one big batch then one clip (clipping each micro-batch would not)."""
    one = _delta(_task(clip=0.05))
    accumulated = _delta(_task(clip=0.05, accumulate=2))
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(one, accumulated))


# ------------------------------------------------------------------------------------------------- freezing
def _steps(task, n: int) -> None:
    """``n`` train steps as the trainer runs them (the position moves after each)."""
    for _ in range(n):
        standard_train_step(task)
        task.clock.step_in_epoch += 1


def _vit_task(tmp_path: Path, *extra: str):
    cfg = compose_config(["config=simclr_vit", *SMALL, *VIT, "optim.warmup_epochs=0", "eval.knn.enabled=false",
                          "log.tensorboard=false", "optim.max_steps=3", f"output_dir={tmp_path}", *extra])
    return build_task(cfg)


def test_a_frozen_parameter_gets_no_update_no_decay_and_no_state(tmp_path: Path) -> None:
    task = _vit_task(tmp_path, "model.freeze=[trunk.patch_embed.*]", "optim.weight_decay=0.5")
    frozen = [task.base_model.trunk.patch_embed.proj.weight, task.base_model.trunk.patch_embed.proj.bias]
    assert all(not p.requires_grad for p in frozen)
    listed = {id(p) for g in task.optimizer.param_groups for p in g["params"]}
    assert not listed & {id(p) for p in frozen}
    before = [p.clone() for p in frozen]
    qkv = task.base_model.trunk.blocks[0].attn.qkv.weight.clone()
    task.start_phase()
    _steps(task, 2)
    assert all(torch.equal(p, b) for p, b in zip(frozen, before))
    assert not torch.equal(task.base_model.trunk.blocks[0].attn.qkv.weight, qkv)
    assert all(id(p) not in {id(q) for q in task.optimizer.state} for p in frozen)


def test_a_parameter_frozen_for_the_first_updates_starts_training_after_them(tmp_path: Path) -> None:
    task = _vit_task(tmp_path, "model.freeze=[{params: 'head.*', steps: 2}]")
    head = list(task.base_model.head.parameters())
    assert all(p.requires_grad for p in head)  # in the optimizer, its gradient dropped while frozen
    before = [p.clone() for p in head]
    task.start_phase()
    _steps(task, 2)
    assert all(torch.equal(p, b) for p, b in zip(head, before))
    assert all(p not in task.optimizer.state for p in head)  # no AdamW moments while frozen
    _steps(task, 1)
    assert any(not torch.equal(p, b) for p, b in zip(head, before))
    assert all(int(task.optimizer.state[p]["step"]) == 1 for p in head if p.ndim > 1)


def test_freeze_entries_are_checked_against_the_models_parameters(tmp_path: Path) -> None:
    """A malformed entry is a config error when the config is composed; a glob that names no parameter, when the
    model is built (validation never builds a model), with the nearest names."""
    base = ["config=simclr_vit", "machine.device=cpu"]
    with pytest.raises(ConfigError, match=r"takes params and one of steps / epochs"):
        compose_config([*base, "model.freeze=[{params: 'head.*', iters: 2}]"])
    cfg = compose_config([*base, "model.freeze=[trunk.patch_embed.*, {params: 'head.*', epochs: 1}]"])
    assert len(cfg.model.freeze) == 2
    with pytest.raises(ConfigError, match=r"'model.freeze\[1\]' = trunk.patch_embd.\* matches no parameter of the "
                                          r"model. Did you mean 'trunk.patch_embed.proj.bias'\? Parameters are "
                                          r"named like trunk.cls_token, trunk.pos_embed, trunk.patch_embed"):
        _vit_task(tmp_path, "model.freeze=[head.*, trunk.patch_embd.*]")
    # the command stops on it before it writes anything (docs/configs.md, "Validation")
    proc = run_main(*base, *SMALL, *VIT, "model.freeze=[trunk.patch_embd.*]", f"output_dir={tmp_path / 'run'}",
                    check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "config error: 'model.freeze[0]' = trunk.patch_embd.* matches no parameter of the model" in proc.stderr
    assert not (tmp_path / "run").exists()
