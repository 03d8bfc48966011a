"""timm's DINOv3 ViTs (rotary position embeddings, registers, LayerScale) as sslkit trunks: timm's own network at
any size, tokens that follow their patches when some are dropped or masked, the RoPE augmentation in training
only, the masked recipes training on them, and the export timm loads strictly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from helpers import RECIPES, SMALL, run_sslkit
from safetensors.torch import load_file

from sslkit.models.rope_vit import DINOV3_ARCHS, build_rope_vit, check_rope_vit_kwargs
from sslkit.models.tokens import TokenTrunk


def _trunk(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = {"in_channels": 1, "img_size": 28, "patch_size": 7, "depth": 2, **kwargs}
    return build_rope_vit("vit_small_patch16_dinov3", **spec).eval()


def _images(n: int = 3, size: int = 28, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 1, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pool", ["cls", "avg"])
def test_the_trunk_is_timms_dinov3_network_at_any_size(pool: str) -> None:
    """timm.create_model(arch, **kwargs) loads the trunk's state dict strictly and computes the same features and
    tokens at the trunk's size and at two other multiples of the patch (RoPE: no table to resample)."""
    trunk = _trunk(pool=pool)
    assert isinstance(trunk, TokenTrunk) and trunk.num_registers == 4 and trunk.out_dim == 384
    arch, spec = trunk.timm_spec()
    twin = timm.create_model(arch, **spec).eval()
    twin.load_state_dict(trunk.state_dict(), strict=True)
    for size in (28, 14, 42):
        x = _images(size=size)
        with torch.no_grad():
            assert torch.equal(trunk(x), twin(x)), size
            tokens, timm_tokens = trunk.forward_tokens(x), twin.forward_features(x)
        assert tokens.grid == (size // 7, size // 7)
        assert torch.equal(tokens.cls, timm_tokens[:, 0]) and torch.equal(tokens.patches, timm_tokens[:, 5:])
        assert torch.equal(trunk.pool_tokens(tokens), trunk(x))
    assert (trunk.in_channels, trunk.base_grid, trunk.num_heads, trunk.patch_size) == (1, (4, 4), 6, 7)


def test_dropped_and_masked_patches_keep_their_rotary_positions() -> None:
    """Encoding only some patches (``keep``, in any order) gives each the token it has when all are encoded and
    attention sees only those, so a permutation of all patches returns the full tokens permuted (each patch's
    rotary embedding travels with it); padding entries left out of attention change nothing; masked patches get
    the mask token (an error before the method enabled it), unmasked ones are untouched by an all-False mask."""
    trunk = _trunk()
    x = _images(2)
    perm = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(s)) for s in (0, 1)])
    with torch.no_grad():
        full = trunk.forward_tokens(x).patches
        permuted = trunk.forward_tokens(x, keep=perm).patches
        torch.testing.assert_close(permuted, full.gather(1, perm[..., None].expand(-1, -1, 384)), rtol=0, atol=1e-6)
        kept = trunk.forward_tokens(x, keep=perm[:, :5]).patches
        padded = torch.cat([perm[:, :5], perm[:, :3]], dim=1)
        valid = torch.tensor([[True] * 5 + [False] * 3] * 2)
        torch.testing.assert_close(trunk.forward_tokens(x, keep=padded, keep_valid=valid).patches[:, :5], kept,
                                   rtol=1e-5, atol=1e-5)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"must call trunk\.enable_mask_token"):
        trunk.forward_tokens(x, mask=mask)
    trunk.enable_mask_token()
    with torch.no_grad():
        assert torch.equal(trunk.forward_tokens(x, mask=mask).patches, full)
        mask[:, :4] = True
        assert not torch.allclose(trunk.forward_tokens(x, mask=mask).patches, full)


def test_the_rope_augmentation_moves_coordinates_in_training_only_and_from_the_seed() -> None:
    """With DINOv3's coordinate jitter and rescale, two training forwards differ, the same seed draws the same
    coordinates, and evaluation uses the coordinates without augmentation (timm's own network's features)."""
    trunk = _trunk(rope_jitter_coords=1.2, rope_rescale_coords=2.0)
    plain = _trunk()
    plain.load_state_dict(trunk.state_dict())
    x = _images()
    with torch.no_grad():
        assert torch.equal(trunk(x), plain(x))  # eval: no augmentation
        trunk.train()
        torch.manual_seed(5)
        a = trunk(x)
        b = trunk(x)
        torch.manual_seed(5)
        assert torch.equal(trunk(x), a) and not torch.allclose(a, b)
    assert "rope_jitter_coords" not in trunk.timm_spec()[1]  # training only: not part of the exported network


def test_the_registry_names_timms_architectures_and_checks_their_keywords() -> None:
    assert set(DINOV3_ARCHS) <= set(timm.list_models("*dinov3*"))
    assert check_rope_vit_kwargs({"depth": 2, "rope_jitter_coords": 1.1, "pool": "avg"}) == []
    errors = check_rope_vit_kwargs({"pool": "max", "num_classes": 3, "deph": 2})
    assert any("pool' must be cls or avg" in e for e in errors)
    assert any("num_classes' is set by sslkit" in e for e in errors)
    assert any("'model.trunk_kwargs.deph' is not an argument" in e and "depth" in e for e in errors)


@pytest.mark.parametrize("recipe", ["dinov2", "mae", "ijepa"])
def test_the_masked_recipes_train_on_it_and_the_export_is_timms(tmp_path: Path, recipe: str) -> None:
    """DINOv2 (mask token), MAE (dropped patches) and I-JEPA (padded context) train on the DINOv3 trunk; the
    export loads into timm's own class strictly and gives the trained trunk's features."""
    from sslkit.launch.cli import main
    from sslkit.tools.pretrained import load_pretrained

    out = tmp_path / "run"
    assert main([f"config={recipe}", *SMALL, *RECIPES[recipe], "model.trunk=vit_small_patch16_dinov3",
                 "+model.trunk_kwargs.depth=2", "optim.max_steps=2", "eval.knn.enabled=false",
                 "log.tensorboard=false", f"output_dir={out}"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
    exported = tmp_path / "encoder.safetensors"
    code, _, err = run_sslkit("export", f"checkpoint={out}", f"output={exported}")
    assert code == 0, err
    meta = json.loads((tmp_path / "encoder.json").read_text())
    twin = timm.create_model(meta["timm_arch"], **meta["timm_kwargs"]).eval()
    twin.load_state_dict(load_file(str(exported)), strict=True)
    trunk = load_pretrained(str(out)).model.trunk.eval()
    side = trunk.base_grid[0] * trunk.patch_size
    x = torch.randn(3, trunk.in_channels, side, side, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(twin(x), trunk(x))


def test_the_teacher_of_a_rope_trunk_sees_unaugmented_coordinates() -> None:
    """DINOv3 runs its teachers in eval mode, so their rotary coordinates are never jittered: a momentum teacher of
    a trunk with the RoPE augmentation (frozen_copy, in train mode as the model) gives the same tokens twice and
    those of the unaugmented trunk, while the student's move from draw to draw."""
    from sslkit.models.teacher import frozen_copy

    student = _trunk(rope_jitter_coords=1.2, rope_rescale_coords=2.0).train()
    teacher = frozen_copy(student).train()
    x = _images()
    with torch.no_grad():
        assert not torch.allclose(student(x), student(x))
        first = teacher(x)
        assert torch.equal(first, teacher(x))
        assert torch.equal(first, student.eval()(x))


def test_the_compiled_trunk_gives_the_eager_tokens_and_gradients() -> None:
    """machine.compile compiles a trunk in place (``Module.compile``), and its masked and dropped-patch forwards go
    through the one compiled ``forward``: with dynamo's graph capture and AOT autograd (aot_eager), the tokens and
    the gradients are the eager ones to float rounding, for the mask token and for kept patches with their
    rotary embeddings."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _trunk().train()
    eager.enable_mask_token()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager")
    x = _images(4)
    mask = torch.rand(4, 16, generator=torch.Generator().manual_seed(2)) < 0.4
    keep = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(s))[:6] for s in range(4)])
    for kwargs in ({"mask": mask}, {"keep": keep}):
        outs = []
        for trunk in (eager, compiled):
            trunk.zero_grad()
            out = trunk(x, tokens=True, **kwargs)
            out.square().mean().backward()
            outs.append((out.detach(), trunk.blocks[0].attn.qkv.weight.grad.clone(),
                         trunk.mask_token.grad.clone() if "mask" in kwargs else None))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-7)
        if "mask" in kwargs:
            torch.testing.assert_close(outs[1][2], outs[0][2], rtol=1e-4, atol=1e-7)
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # captured, not run eagerly
