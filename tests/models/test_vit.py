"""ViT trunks: timm's network itself, tokens, dropping and replacing patches, position embeddings, config errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import timm
import torch
from helpers import SMALL, VIT
from timm.layers import resample_abs_pos_embed

from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.launch.audit import StepAudit
from sslkit.models.tokens import resample_matrix, sincos_pos_embed
from sslkit.models.vit import build_vit
from sslkit.models.vit_trunk import ViTTrunk


def _vit(**kwargs) -> ViTTrunk:
    torch.manual_seed(0)
    spec = {"in_channels": 1, "img_size": 28, "patch_size": 7, "depth": 2, "num_heads": 3, **kwargs}
    return build_vit("vit_tiny", **spec).eval()


def _images(n: int = 3, size: int = 28, channels: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, channels, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kwargs", [{}, {"pool": "avg", "reg_tokens": 2, "qk_norm": True, "layer_scale_init": 1e-5},
                                    {"pos_embed": "sincos", "in_channels": 3}])
def test_the_trunk_is_timms_network(kwargs: dict) -> None:
    """timm.create_model(arch, **kwargs) loads the trunk's state dict strictly and computes the same features, at the
    trunk's size and at another multiple of the patch (resampled position embeddings)."""
    trunk = _vit(**kwargs)
    arch, spec = trunk.timm_spec()
    twin = timm.create_model(arch, **spec).eval()
    twin.load_state_dict(trunk.state_dict(), strict=True)
    channels = kwargs.get("in_channels", 1)
    for size in (28, 14, 42):
        x = _images(size=size, channels=channels)
        with torch.no_grad():
            assert torch.allclose(trunk(x), twin(x), atol=1e-5), size
    assert trunk(x).shape == (3, 192) and trunk.out_dim == 192


def test_tokens_are_timms_features_split_and_pooled_as_configured() -> None:
    trunk = _vit(reg_tokens=2)
    x = _images()
    with torch.no_grad():
        everything = trunk.forward_features(x)  # timm: [B, 1 + 2 + 16, D] after the final norm
        t = trunk.forward_tokens(x)
    assert torch.equal(t.cls, everything[:, 0]) and torch.equal(t.registers, everything[:, 1:3])
    assert torch.equal(t.patches, everything[:, 3:]) and t.grid == (4, 4) and t.patches.shape[1] == 16
    assert torch.equal(trunk.pool_tokens(t), t.cls)
    avg = _vit(reg_tokens=2, pool="avg")
    with torch.no_grad():
        t = avg.forward_tokens(x)
        assert torch.allclose(avg(x), t.patches.mean(dim=1), atol=1e-6)  # registers and CLS are not averaged


def _manual_tokens(trunk: ViTTrunk, x: torch.Tensor, keep: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """The encoder written out step by step from timm's parts: embed, (replace), add positions, (gather), prefix,
    blocks, norm."""
    emb = trunk.patch_embed.proj(x).flatten(2).transpose(1, 2)  # [B, N, D], raster order
    if mask is not None:
        emb = torch.where(mask[..., None], trunk.mask_token.expand_as(emb), emb)
    emb = emb + trunk.pos_embed
    if keep is not None:
        emb = torch.stack([emb[b, keep[b]] for b in range(emb.shape[0])])
    tokens = torch.cat([trunk.cls_token.expand(emb.shape[0], -1, -1), emb], dim=1)
    for block in trunk.blocks:
        tokens = block(tokens)
    return trunk.norm(tokens)


def test_dropping_patches_encodes_only_the_kept_ones() -> None:
    trunk = _vit()
    x = _images()
    keep = torch.tensor([[0, 5, 6, 15], [1, 2, 3, 4], [7, 8, 12, 13]])
    with torch.no_grad():
        t = trunk.forward_tokens(x, keep=keep)
        ref = _manual_tokens(trunk, x, keep=keep)
    assert t.patches.shape == (3, 4, 192)
    assert torch.allclose(torch.cat([t.cls[:, None], t.patches], 1), ref, atol=1e-5)


def test_replacing_patches_puts_the_mask_token_before_the_positions() -> None:
    trunk = _vit()
    with pytest.raises(RuntimeError, match="enable_mask_token"):
        trunk.forward_tokens(_images(), mask=torch.zeros(3, 16, dtype=torch.bool))
    trunk.enable_mask_token()
    with torch.no_grad():
        trunk.mask_token.normal_()
    x = _images()
    mask = torch.rand(3, 16, generator=torch.Generator().manual_seed(3)) < 0.4
    with torch.no_grad():
        t = trunk.forward_tokens(x, mask=mask)
        ref = _manual_tokens(trunk, x, mask=mask)
        assert torch.allclose(torch.cat([t.cls[:, None], t.patches], 1), ref, atol=1e-5)
        # the masked patches' pixels no longer matter
        other = x.clone()
        other[0, :, :7, :7] = 5.0  # patch 0 of image 0
        mask[0, 0] = True
        assert torch.allclose(trunk.forward_tokens(other, mask=mask).cls, trunk.forward_tokens(x, mask=mask).cls)


def test_padding_slots_left_out_of_attention_change_nothing() -> None:
    """keep_valid: the same patches plus padding slots marked invalid give the tokens of the patches alone."""
    trunk = _vit()
    x = _images()
    keep = torch.tensor([[0, 5, 6], [1, 2, 3], [7, 12, 13]])
    padded = torch.cat([keep, torch.tensor([[9, 10], [11, 0], [4, 4]])], dim=1)
    valid = torch.tensor([[True] * 3 + [False] * 2] * 3)
    with torch.no_grad():
        alone = trunk.forward_tokens(x, keep=keep)
        with_padding = trunk.forward_tokens(x, keep=padded, keep_valid=valid)
    assert torch.allclose(with_padding.cls, alone.cls, atol=1e-5)
    assert torch.allclose(with_padding.patches[:, :3], alone.patches, atol=1e-5)


def test_sincos_position_embeddings_follow_the_formula() -> None:
    dim, (h, w) = 8, (3, 5)
    got = sincos_pos_embed(dim, (h, w))
    for i in range(h):
        for j in range(w):
            expected = []
            for coordinate in (j, i):  # MAE: the column half first
                omegas = [1.0 / 10000 ** (k / (dim // 4)) for k in range(dim // 4)]
                expected += [math.sin(coordinate * o) for o in omegas] + [math.cos(coordinate * o) for o in omegas]
            assert torch.allclose(got[i * w + j], torch.tensor(expected), atol=1e-6)
    trunk = _vit(pos_embed="sincos")
    assert not trunk.pos_embed.requires_grad and torch.allclose(trunk.pos_embed[0], sincos_pos_embed(192, (4, 4)))


@pytest.mark.parametrize(("old", "new"), [((4, 4), (2, 2)), ((14, 14), (6, 6)), ((4, 4), (6, 6)), ((3, 5), (4, 2))])
def test_resampling_is_timms_bicubic_without_its_nondeterministic_backward(old, new) -> None:
    pos = torch.randn(1, old[0] * old[1], 16, requires_grad=True)
    ours = (resample_matrix(old, new, pos.device) @ pos[0])[None]
    theirs = resample_abs_pos_embed(pos, new_size=list(new), old_size=list(old), num_prefix_tokens=0)
    assert torch.allclose(ours, theirs, atol=1e-5)
    with StepAudit() as audit:
        (resample_matrix(old, new, pos.device) @ pos[0]).sum().backward()
    assert [f for f in audit.findings if f.kind == "nondeterministic"] == []


def test_local_crops_of_a_trunk_train_without_nondeterministic_ops() -> None:
    trunk = _vit().train()
    with StepAudit() as audit:
        (trunk(_images(size=14)).sum() + trunk(_images()).sum()).backward()
    assert [f for f in audit.findings if f.kind == "nondeterministic"] == []
    assert trunk.pos_embed.grad is not None and trunk.pos_embed.grad.abs().sum() > 0


def test_layer_ids_follow_beit_mae_and_dinov2() -> None:
    trunk = _vit(reg_tokens=1)
    trunk.enable_mask_token()
    assert trunk.num_layers == 3  # 2 blocks + 1
    for name, _ in trunk.named_parameters():
        expected = 0 if name.split(".")[0] in ("cls_token", "reg_token", "pos_embed", "mask_token", "patch_embed") \
            else int(name.split(".")[1]) + 1 if name.startswith("blocks.") else 3
        assert trunk.layer_id(name) == expected, name
    assert {"pos_embed", "cls_token", "reg_token", "mask_token"} == trunk.no_weight_decay_names()


# ------------------------------------------------------------------------------------------ config errors
def _error(*args: str) -> str:
    with pytest.raises(ConfigError) as info:
        compose_config(["machine.device=cpu", *args])
    return str(info.value)


def test_a_patch_size_that_does_not_fit_the_crops_names_the_keys() -> None:
    msg = _error("config=simclr", "model.trunk=vit_tiny", "model.trunk_kwargs.patch_size=8")
    assert "'data.image_size' = 28 is not a multiple of the ViT's patch size 8" in msg
    msg = _error("config=dino", "model.trunk=vit_tiny", "model.trunk_kwargs.patch_size=7")
    assert "'data.small_image_size' = 12 is not a multiple" in msg and "data.image_size" not in msg
    msg = _error("config=simclr", "model.trunk=vit_tiny", "data.patch_size=32")
    assert "'data.image_size' = 28 is smaller than one patch" in msg


def test_unknown_or_controlled_vit_kwargs_and_values_are_config_errors() -> None:
    msg = _error("config=simclr", "model.trunk=vit_tiny", "+model.trunk_kwargs.drop_path=0.1")
    assert "'model.trunk_kwargs.drop_path' is not an argument of sslkit's ViT nor of timm's" in msg
    assert "drop_path_rate" in msg  # the closest name
    assert "'model.trunk_kwargs.init_values' is set by sslkit" in _error(
        "config=simclr", "model.trunk=vit_tiny", "+model.trunk_kwargs.init_values=0.1")
    assert "must be cls or avg" in _error("config=simclr", "model.trunk=vit_tiny", "+model.trunk_kwargs.pool=mean")
    assert "unknown trunk 'vit_tinny'" in _error("config=simclr", "model.trunk=vit_tinny")
    # a timm argument sslkit does not name passes through
    cfg = compose_config(["config=simclr", "machine.device=cpu", "model.trunk=vit_tiny",
                          "+model.trunk_kwargs.mlp_ratio=2.0"])
    assert cfg.model.trunk_kwargs.mlp_ratio == 2.0


def test_masked_methods_need_a_vit_and_a_mask_ratio_in_range(tmp_path: Path) -> None:
    msg = _error("config=mae", "model.trunk=small_cnn", "model.trunk_kwargs={}")
    assert "method mae reads a ViT's patch tokens" in msg and "'masking.name' = random hides patches" in msg
    assert "masking.ratio must be in [0, 1), got 1.0" in _error("config=mae", "masking.ratio=1.0")
    assert "method mae trains on masked patches" in _error("config=mae", "masking.name=none")
    assert "method simclr does not use masks" in _error("config=simclr", "model.trunk=vit_tiny", "masking.name=random")
    assert "unknown masking 'randm'" in _error("config=mae", "masking.name=randm")
    # MAE's decoder restores exactly the hidden patches: generators replacing them, or padding kept ones, are refused
    assert "method mae needs masks that drop the masked patches: use masking.name=random" in _error(
        "config=mae", "masking={name: block}")
    assert "padded to a fixed count, and method mae" in _error("config=mae", "masking={name: multi_block}")
    # before anything is written: the CLI stops with a message and makes no run folder
    from sslkit.launch.cli import main

    assert main(["config=mae", "machine.device=cpu", "masking.ratio=-0.1", f"output_dir={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["simclr", "moco", "mocov3", "byol", "simsiam", "swav", "dino", "barlow_twins",
                                    "vicreg"])
def test_every_cnn_recipe_trains_a_step_on_a_vit(recipe: str, tmp_path: Path) -> None:
    from helpers import RECIPES

    from sslkit.builder import build_task
    from sslkit.train_steps.standard import standard_train_step

    cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], "model.trunk=vit_tiny", *VIT,
                          "optim.warmup_epochs=0", "eval.knn.enabled=false", "log.tensorboard=false",
                          f"output_dir={tmp_path}"])
    task = build_task(cfg)
    before = {k: v.clone() for k, v in task.base_model.trunk.state_dict().items()}
    task.start_phase()
    standard_train_step(task)
    task.close()
    assert torch.isfinite(task.last_batch.reduced_loss)
    changed = [k for k, v in task.base_model.trunk.state_dict().items() if not torch.equal(v, before[k])]
    assert "blocks.0.attn.qkv.weight" in changed


def test_interpolated_crops_are_multiples_of_the_patch_in_every_view() -> None:
    """The 12 px local crops of a CNN recipe fit patch 4 (data.patch_size of fashion_mnist): no error."""
    cfg = compose_config(["config=dino", "machine.device=cpu", "model.trunk=vit_tiny"])
    assert cfg.data.patch_size == 4 and cfg.data.transform.small_size == 12


def test_the_vit_trunk_meets_the_token_trunk_interface() -> None:
    """ViTTrunk is a TokenTrunk: what MAE's and I-JEPA's builders read (input channels, the grid of its own size,
    heads) comes from timm's modules, and the grid of another input size is its patch count per side."""
    from sslkit.models.tokens import TokenTrunk

    trunk = _vit(in_channels=3, img_size=35, num_heads=4)
    assert isinstance(trunk, TokenTrunk)
    assert (trunk.in_channels, trunk.base_grid, trunk.num_heads, trunk.patch_size) == (3, (5, 5), 4, 7)
    assert trunk.grid(28, 42) == (4, 6)


def test_a_users_token_trunk_gets_its_tokens_used_and_is_told_what_it_lacks() -> None:
    """A user's ViT-like trunk subclasses TokenTrunk and gives forward_tokens and pool_tokens: the model's
    encode_views hands its tokens on with its pooled features (views of equal size in one forward); a method that
    needs what it does not give (iBOT's mask token) says so, naming the class; a trunk that is no TokenTrunk
    gives features only."""
    from sslkit.methods.dino import DINOHead
    from sslkit.methods.ibot import IBOTModel
    from sslkit.models.ssl_model import encode_views
    from sslkit.models.tokens import Tokens, TokenTrunk

    class Patches(TokenTrunk):
        out_dim = 4

        def forward_tokens(self, x, keep=None, mask=None, keep_valid=None) -> Tokens:
            p = x.flatten(2).transpose(1, 2)[..., :4]  # [B, HW, 4]
            return Tokens(cls=p.mean(1), registers=p[:, :0], patches=p, grid=(x.shape[-2], x.shape[-1]))

        def pool_tokens(self, tokens: Tokens) -> torch.Tensor:
            return tokens.cls * 2

    views = [torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3), torch.randn(2, 4, 2, 2)]
    features, tokens = encode_views(Patches(), views)
    assert tokens is not None and [t.grid for t in tokens] == [(3, 3), (3, 3), (2, 2)]
    for v, f, t in zip(views, features, tokens):
        torch.testing.assert_close(f, 2 * v.flatten(2).transpose(1, 2).mean(1))
        assert torch.equal(t.patches, v.flatten(2).transpose(1, 2))
    with pytest.raises(NotImplementedError, match="Patches has no mask token"):
        IBOTModel(Patches(), DINOHead(in_dim=4, out_dim=8, hidden_dim=8, bottleneck_dim=4))
    features, tokens = encode_views(torch.nn.Flatten(), views[:1])
    assert tokens is None and features[0].shape == (2, 36)
