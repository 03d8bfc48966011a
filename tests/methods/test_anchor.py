"""The anchor to the starting model (issue 65 item 4): its loss written out and on hand-made cases, the student held
to a frozen copy of the starting trunk on the same crops and masks (0 at the start, exactly), that copy never
trained, and the config rule that keeps the weight and the copy together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import RECIPES, SMALL, run_main

from sslkit.builder.model import build_model
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.methods.anchor import anchor_loss
from sslkit.methods.dinov3 import DINOv3Loss
from sslkit.models.masking import Masks

ANCHOR = ["model.kwargs.anchor=true", "+loss.anchor_weight=2.0"]
D3 = ["config=dinov3", *SMALL, *RECIPES["dinov3"], "model.trunk_kwargs.drop_path_rate=0.0"]


def test_the_anchor_loss_is_one_minus_cosine_or_the_squared_difference_of_cls_and_patch_tokens() -> None:
    cls_s, cls_t = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])  # orthogonal: 1 - 0
    patches_s = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    patches_t = torch.tensor([[[2.0, 0.0], [-1.0, -1.0]]])  # the same direction (0), opposite (2): mean 1
    assert anchor_loss(cls_s, patches_s, cls_t, patches_t, "cosine").item() == pytest.approx(2.0)
    # (1 - 0)^2, (0 - 3)^2 over 2 entries; patches: 1, 0, 4, 4 over 4
    assert anchor_loss(cls_s, patches_s, cls_t, patches_t, "mse").item() == pytest.approx(5.0 + 2.25)
    g = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randn(3, 5, generator=g), torch.randn(3, 4, 5, generator=g), torch.randn(3, 5, generator=g),
                  torch.randn(3, 4, 5, generator=g))
    want = (1 - (a * c).sum(-1) / (a.norm(dim=-1) * c.norm(dim=-1))).mean() + \
        (1 - (b * d).sum(-1) / (b.norm(dim=-1) * d.norm(dim=-1))).mean()
    torch.testing.assert_close(anchor_loss(a, b, c, d), want)
    torch.testing.assert_close(anchor_loss(a, b, 4 * c, 0.5 * d), want)  # cosine: the targets' scale is no matter
    torch.testing.assert_close(anchor_loss(a, b, c, d, "mse"), ((a - c) ** 2).mean() + ((b - d) ** 2).mean())


def _views() -> tuple[list[torch.Tensor], list[Masks | None]]:
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(3, 3, 32, 32, generator=g) for _ in range(2)] + [torch.randn(3, 3, 16, 16, generator=g)]
    return views, [Masks((4, 4), torch.rand(3, 16, generator=g) < 0.4) for _ in range(2)]


def test_the_student_is_held_to_the_frozen_starting_trunk_on_the_same_crops_and_masks() -> None:
    torch.manual_seed(0)
    model = build_model(compose_config([*D3, *ANCHOR]), in_channels=3)
    assert model.anchor_trunk is not None and model.anchor_trunk in model.trunk_copies()
    assert not any(p.requires_grad for p in model.anchor_trunk.parameters())  # never in an optimizer
    views, masks = _views()
    loss = DINOv3Loss(out_dim=16, patch_out_dim=16, anchor_weight=2.0).train()
    out = model(views, masks)
    for mine, start in zip(out["anchor_tokens"], out["anchor_targets"]):  # the same network on the same masked
        assert torch.equal(mine, start)                                    # crops: the same tokens, to the bit
    assert loss(out, {})["anchor_loss"].item() < 1e-6  # (1 - cos(x, x): float rounding of the norms)
    with torch.no_grad():
        model.trunk.blocks[0].attn.proj.weight.add_(0.1)  # the student moves away
    moved = model(views, masks)
    cls_s, patches_s = moved["anchor_tokens"]
    mask = torch.cat([m.mask for m in masks])
    with torch.no_grad():
        target = model.anchor_trunk.forward_tokens(torch.cat(views[:2]), mask=mask)
    want = (1 - F.cosine_similarity(cls_s, target.cls, dim=-1)).mean() + \
        (1 - F.cosine_similarity(patches_s, target.patches, dim=-1)).mean()
    parts = DINOv3Loss(out_dim=16, patch_out_dim=16, anchor_weight=2.0).train()(moved, {})
    torch.testing.assert_close(parts["anchor_loss"], want.detach())
    assert parts["anchor_loss"].item() > 0
    without = DINOv3Loss(out_dim=16, patch_out_dim=16).train()(moved, {})  # the same output and state, weight 0
    torch.testing.assert_close(parts["loss"], without["loss"] + 2.0 * want, rtol=1e-6, atol=1e-6)
    parts["loss"].backward()
    assert model.trunk.blocks[0].attn.proj.weight.grad is not None
    assert all(p.grad is None for p in model.anchor_trunk.parameters())


@pytest.mark.parametrize(("extra", "said"), [
    (["+loss.anchor_weight=1.0"], "needs the frozen copy of the starting trunk: set model.kwargs.anchor=true"),
    (["model.kwargs.anchor=true"], "holds a frozen copy of the trunk that nothing reads"),
    ([*ANCHOR, "+loss.anchor_metric=l1"], "'loss.anchor_metric' = l1: use one of cosine, mse"),
])
def test_the_anchors_weight_and_copy_go_together(extra: list[str], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        compose_config([*D3, *extra])


def test_a_run_with_the_anchor_logs_it_and_keeps_the_starting_trunk_in_its_checkpoint(tmp_path: Path) -> None:
    import json

    out = tmp_path / "run"
    run_main(*D3, *ANCHOR, "optim.max_steps=2", "log.every_n_steps=1", "eval.knn.enabled=false", f"output_dir={out}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert next(r["anchor_loss"] for r in lines if "anchor_loss" in r) < 1e-6  # step 1: the student is the start
    state = torch.load(next((out / "checkpoints").glob("checkpoint_*.pt")), map_location="cpu", weights_only=False)
    assert any(k.startswith("anchor_trunk.") for k in state["model"])
