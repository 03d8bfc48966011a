"""model.pretrained: released backbone weights, in timm's layout or Meta's DINOv3 layout (written here from a timm
model, since no hub is reachable), load into the trunk and its teachers and give timm's features; a file of another
network, a corrupt file or a missing one is a message that says what differs, before training."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from helpers import RECIPES, SMALL
from safetensors.torch import save_file

from sslkit.builder.model import build_model
from sslkit.config.compose import compose_config
from sslkit.models.weights import WeightsError, adapt_channels, load_backbone

ROPE = ["model.trunk=vit_small_patch16_dinov3", "+model.trunk_kwargs.depth=2"]


def _model(*extra: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], *extra]), in_channels=3)


def _released(model: torch.nn.Module, seed: int = 7, **changes) -> torch.nn.Module:
    """timm's own network of the model's trunk architecture (its spec, with ``changes``), other weights."""
    arch, spec = model.trunk.timm_spec()
    torch.manual_seed(seed)
    return timm.create_model(arch, **{**spec, **changes}).eval()


def _meta_dinov3(state: dict[str, torch.Tensor], dim: int) -> dict[str, torch.Tensor]:
    """timm's Eva keys in the layout of facebookresearch/dinov3's ``DinoVisionTransformer`` (``storage_tokens``,
    ``ls1.gamma``, ``ls2.gamma``, ``rope_embed.periods``, a ``mask_token`` of shape [1, D])."""
    out = {}
    for key, value in state.items():
        key = key.replace("reg_token", "storage_tokens").replace("gamma_1", "ls1.gamma").replace("gamma_2", "ls2.gamma")
        out[key] = value
    out["rope_embed.periods"] = torch.arange(1.0, 9.0)
    out["mask_token"] = torch.full((1, dim), 0.5)
    return out


def _same_function(trunk: torch.nn.Module, reference: torch.nn.Module) -> None:
    """The same features at the trunk's size and another (sslkit's ViT resamples its position table there by a
    matrix product where timm interpolates: equal to float rounding; RoPE has no table)."""
    trunk.eval()
    for size in (32, 48):
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
        with torch.no_grad():
            torch.testing.assert_close(trunk(x), reference(x), rtol=0, atol=1e-5 if size != 32 else 0)


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
@pytest.mark.parametrize("trunk", ["vit", "rope"])
def test_timms_layout_loads_into_the_trunk_and_its_teachers(tmp_path: Path, kind: str, trunk: str) -> None:
    model = _model(*(ROPE if trunk == "rope" else []))
    released = _released(model)
    path = tmp_path / f"backbone.{kind}"
    if kind == "safetensors":
        save_file(released.state_dict(), str(path))
    else:
        torch.save(released.state_dict(), path)
    head_before = {k: v.clone() for k, v in model.head.state_dict().items()}
    fresh = load_backbone(model, path)
    assert fresh == ["mask_token"]  # timm's layout has none: it starts as the method made it
    _same_function(model.trunk, released)
    teacher = model.teacher_trunk.state_dict()
    assert all(torch.equal(v, teacher[k]) for k, v in model.trunk.state_dict().items())  # the teacher starts equal
    assert all(torch.equal(v, head_before[k]) for k, v in model.head.state_dict().items())  # heads start fresh


def test_metas_dinov3_layout_and_its_training_checkpoint_load_with_the_mask_token(tmp_path: Path) -> None:
    """A released DINOv3 file (Meta's keys, converted by timm's own converter) and the same weights as the EMA
    teacher of a training checkpoint (``teacher`` / ``backbone.``): timm's features, and the mask token the file
    holds (the method uses one)."""
    model = _model(*ROPE)
    released = _released(model)
    meta = _meta_dinov3(released.state_dict(), model.trunk.out_dim)
    torch.save(meta, tmp_path / "dinov3_vits16.pth")
    assert load_backbone(model, tmp_path / "dinov3_vits16.pth") == []
    _same_function(model.trunk, released)
    assert torch.equal(model.trunk.mask_token, torch.full((1, 1, 384), 0.5))
    assert torch.equal(model.teacher_trunk.mask_token, model.trunk.mask_token)
    other = _model(*ROPE)
    torch.save({"teacher": {f"backbone.{k}": v for k, v in meta.items()}, "iteration": 3}, tmp_path / "train.pth")
    load_backbone(other, tmp_path / "train.pth")
    _same_function(other.trunk, released)


def test_a_file_of_another_network_says_what_differs(tmp_path: Path) -> None:
    model = _model(*ROPE)
    cases = {"deeper": (_released(model, depth=3), "3 blocks (the trunk's 2)"),
             "patch": (_released(model, patch_size=4), "patch 4 px (the trunk's 8"),
             "wider": (_released(model, embed_dim=192, num_heads=3), "width 192 (the trunk's 384)")}
    for name, (network, expected) in cases.items():
        save_file(network.state_dict(), str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(WeightsError, match=r"is another network than model.trunk=vit_small_patch16_dinov3") as e:
            load_backbone(model, tmp_path / f"{name}.safetensors")
        assert expected in str(e.value), (name, str(e.value))
    vit = _model()
    registers = _released(vit, reg_tokens=4)
    save_file(registers.state_dict(), str(tmp_path / "reg.safetensors"))
    with pytest.raises(WeightsError, match=r"4 register tokens \(the trunk's 0\)"):
        load_backbone(vit, tmp_path / "reg.safetensors")
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(WeightsError, match=r"its keys do not fit .*not in the trunk: encoder.weight"):
        load_backbone(model, tmp_path / "other.safetensors")
    good = tmp_path / "cut.safetensors"
    save_file(_released(model).state_dict(), str(good))
    (tmp_path / "cut2.safetensors").write_bytes(good.read_bytes()[:1000])
    with pytest.raises(WeightsError, match=r"cannot be read as weights .* download it again"):
        load_backbone(model, tmp_path / "cut2.safetensors")


def test_the_command_line_continues_from_released_weights_or_says_why_not(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run with model.pretrained trains from the file's weights (logged); a file of another network stops the
    run with the difference (exit 2, no traceback); a missing file is a config error before any folder is made."""
    from sslkit.launch.cli import main

    model = _model(*ROPE)
    save_file(_released(model).state_dict(), str(tmp_path / "w.safetensors"))
    save_file(_released(model, depth=3).state_dict(), str(tmp_path / "deep.safetensors"))
    base = ["config=dinov2", *SMALL, *RECIPES["dinov2"], *ROPE, "optim.max_steps=1", "eval.knn.enabled=false",
            "log.tensorboard=false"]
    assert main([*base, f"model.pretrained={tmp_path / 'w.safetensors'}", f"output_dir={tmp_path / 'ok'}"]) == 0
    assert "model.pretrained: " in capsys.readouterr().out + (tmp_path / "ok" / "log.txt").read_text()
    assert main([*base, f"model.pretrained={tmp_path / 'deep.safetensors'}", f"output_dir={tmp_path / 'deep'}"]) == 2
    err = capsys.readouterr().err
    assert "3 blocks (the trunk's 2)" in err and "Traceback" not in err
    two = ["data.train.kwargs.channels=2", "data.test.kwargs.channels=2"]
    assert main([*base, *two, f"model.pretrained={tmp_path / 'w.safetensors'}", f"output_dir={tmp_path / 'two'}"]) == 2
    err = capsys.readouterr().err
    assert "reads 3-channel images and the data has 2; model.pretrained_channels=fino widens" in err
    assert "Traceback" not in err and not (tmp_path / "two").exists()
    assert main([*base, f"model.pretrained={tmp_path / 'none.pth'}", f"output_dir={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err
    assert "'model.pretrained' = " in err and "does not exist" in err and not (tmp_path / "none").exists()


@pytest.mark.parametrize("registers", [0, 4])
def test_metas_dinov2_layout_loads_into_sslkits_vit(tmp_path: Path, registers: int) -> None:
    """A released DINOv2 file (Meta's keys: the CLS token's own position embedding in ``pos_embed``,
    ``register_tokens``, ``mask_token``) into sslkit's ViT, whose CLS token has no position embedding: the CLS
    token takes its position in (the same sum before the first block), and the features are timm's own network's."""
    extra = [f"+model.trunk_kwargs.reg_tokens={registers}"] if registers else []
    model = _model(*extra)
    released = _released(model)
    state = released.state_dict()
    cls_position = state["cls_token"] / 2  # (cls - cls / 2) + cls / 2 == cls exactly: the fold, not rounding, is tested
    meta = {k: v for k, v in state.items() if k not in ("cls_token", "pos_embed", "reg_token")}
    meta["cls_token"] = state["cls_token"] - cls_position
    meta["pos_embed"] = torch.cat([cls_position, state["pos_embed"]], dim=1)
    if registers:
        meta["register_tokens"] = state["reg_token"]
    meta["mask_token"] = torch.full((1, state["cls_token"].shape[-1]), 0.25)
    torch.save(meta, tmp_path / "dinov2.pth")
    assert load_backbone(model, tmp_path / "dinov2.pth") == []
    model.trunk.eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model.trunk(x), released(x), rtol=0, atol=0)
    assert torch.equal(model.trunk.mask_token, torch.full((1, 1, model.trunk.out_dim), 0.25))


def test_the_fino_rule_widens_with_the_mean_filter_and_narrows_grey_by_the_sum() -> None:
    """DINOv3's FINO ``expand_patch_embed`` written out (3 -> 5: the new filters the mean of the three, everything
    times 3/5); narrowed to one channel, the sum. Both keep the activation of an image whose channels agree, which is
    what a grey image read by an RGB network is."""
    w = torch.randn(6, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    wide = adapt_channels(w, 5)
    torch.testing.assert_close(wide[:, :3], w * 3 / 5)
    torch.testing.assert_close(wide[:, 3], w.mean(dim=1) * 3 / 5)
    torch.testing.assert_close(wide[:, 4], w.mean(dim=1) * 3 / 5)
    torch.testing.assert_close(adapt_channels(w, 1), w[:, :1] + w[:, 1:2] + w[:, 2:])
    grey = torch.randn(2, 1, 4, 4)
    conv = torch.nn.functional.conv2d
    torch.testing.assert_close(conv(grey.expand(-1, 5, -1, -1), wide), conv(grey.expand(-1, 3, -1, -1), w))
    torch.testing.assert_close(conv(grey, adapt_channels(w, 1)), conv(grey.expand(-1, 3, -1, -1), w))
    # timm's adapt_input_conv: repeated in turn (channels 0, 1, 2, 0, 1), times 3/5; narrowed to 2: the first two
    torch.testing.assert_close(adapt_channels(w, 5, "timm"), w[:, [0, 1, 2, 0, 1]] * 3 / 5)
    torch.testing.assert_close(adapt_channels(w, 2, "timm"), w[:, :2] * 3 / 2)
    assert adapt_channels(w, 3, "refuse") is w
    with pytest.raises(WeightsError, match=r"fino widens, or narrows to one channel only: .*pretrained_channels=timm"):
        adapt_channels(w, 2)
    with pytest.raises(WeightsError, match=r"reads 3-channel images and the data has 4 \(model.pretrained_channels="
                                           r"refuse\)"):
        adapt_channels(w, 4, "refuse")


@pytest.mark.parametrize("trunk", ["vit", "rope"])
@pytest.mark.parametrize("channels", [1, 4])
def test_an_rgb_release_loads_for_grey_and_four_channel_data_as_the_same_function(tmp_path: Path, trunk: str,
                                                                                    channels: int) -> None:
    """An RGB file into a trunk for 1- or 4-channel data: on an image whose channels agree the trunk gives exactly
    the released network's features of the RGB image with those channels (the rule keeps the activation)."""
    extra = ROPE if trunk == "rope" else []
    rgb = _model(*extra)
    save_file(_released(rgb).state_dict(), str(tmp_path / "w.safetensors"))
    torch.manual_seed(0)
    model = build_model(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], *extra]), in_channels=channels)
    load_backbone(model, tmp_path / "w.safetensors")
    reference = _released(rgb)
    model.trunk.eval()
    grey = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model.trunk(grey.expand(-1, channels, -1, -1)), reference(grey.expand(-1, 3, -1, -1))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    with pytest.raises(WeightsError, match=r"model\.pretrained_channels=refuse"):
        load_backbone(build_model(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], *extra]),
                                  in_channels=channels), tmp_path / "w.safetensors", "refuse")


def test_a_part_of_a_backbone_stops_the_load_with_both_lists_unless_asked_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file that leaves a trunk tensor unset and holds one with no place in the trunk: the load stops naming both
    (no quiet partial load); model.pretrained_partial=true loads the rest, the lists in a warning."""
    import logging

    model = _model()
    state = _released(model).state_dict()
    cut = {k: v for k, v in state.items() if k != "blocks.1.mlp.fc2.bias"}
    save_file({**cut, "adapter.weight": torch.zeros(2, 2)}, str(tmp_path / "part.safetensors"))
    with pytest.raises(WeightsError, match=r"not in the trunk: adapter\.weight; not in the file: blocks\.1\.mlp\.fc2"
                                           r"\.bias\).*model\.pretrained_partial=true"):
        load_backbone(model, tmp_path / "part.safetensors")
    with caplog.at_level(logging.WARNING, logger="sslkit"):
        missing = load_backbone(model, tmp_path / "part.safetensors", partial=True)
    assert "blocks.1.mlp.fc2.bias" in missing and "loaded in part (model.pretrained_partial=true)" in caplog.text
    assert "left at their fresh values: blocks.1.mlp.fc2.bias" in caplog.text and "in the trunk: adapter.weight" in \
        caplog.text
    assert torch.equal(model.trunk.state_dict()["blocks.0.mlp.fc2.bias"], state["blocks.0.mlp.fc2.bias"])
