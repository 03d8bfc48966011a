"""Momentum teachers are deterministic in training: no dropout and no drop path, whatever the student has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, VIT
from timm.layers import DropBlock2d, DropPath, PatchDropout
from torch import nn
from torchvision.ops import StochasticDepth

from sslkit.builder import build_model
from sslkit.config.compose import compose_config
from sslkit.models.teacher import frozen_copy, silence

#: The recipes whose model has a momentum teacher (``momentum_pairs``), the CNN ones given a ViT trunk (a ResNet has
#: no stochastic layer to switch off), and the paper-scale ones with small heads (their trunks are what matters).
TEACHER_RECIPES = ["moco", "mocov3", "byol", "dino", "dino_vit", "mocov3_vit", "ibot", "dinov2", "ijepa"]
PAPER = [f"{m}_{s}" for m in ("dinov2", "ibot", "ijepa") for s in ("vits16", "vitb16")]


class Noisy(nn.Module):
    """Every kind of stochastic layer :func:`silence` knows, around a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.block = DropBlock2d(0.5, block_size=3)
        self.dropout2d = nn.Dropout2d(0.5)
        self.depth = StochasticDepth(0.5, "row")
        self.path = DropPath(0.5)
        self.patches = PatchDropout(0.5, num_prefix_tokens=1)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout2d(self.block(self.bn(self.conv(x))))
        h = self.path(self.depth(h))
        tokens = self.patches(h.flatten(2).transpose(1, 2))  # 16 tokens: the first kept, half of the others
        return self.dropout(tokens)


def test_a_frozen_copy_has_no_noise_and_keeps_batch_norm_on_the_batch() -> None:
    torch.manual_seed(0)
    student = Noisy().train()
    teacher = frozen_copy(student)
    x = torch.randn(4, 3, 4, 4)
    assert not torch.equal(student(x), student(x))  # the student still draws its noise
    before = teacher.bn.running_mean.clone()
    first, second = teacher(x), teacher(x)
    assert torch.equal(first, second)
    assert teacher.training and not torch.equal(teacher.bn.running_mean, before)  # BatchNorm on the batch (MoCo)
    # switched off: the same output as the student's own layers in eval mode, but BatchNorm in train mode
    reference = Noisy()
    reference.load_state_dict(student.state_dict())
    reference.train()
    for layer in (reference.block, reference.dropout2d, reference.depth, reference.path, reference.patches,
                  reference.dropout):
        layer.eval()
    torch.testing.assert_close(first, reference(x), rtol=0, atol=0)
    assert silence(Noisy()) == ["block", "dropout2d", "depth", "path", "patches", "dropout"]
    assert silence(teacher) == []  # nothing left to switch off


def _model(recipe: str, folder: Path) -> nn.Module:
    if recipe in PAPER:
        (folder / "a.jpg").touch()  # the config check looks for an image file
        overrides = [f"config={recipe}", "data=folder", f"data.train.path={folder}", "machine.device=cpu"]
        if not recipe.startswith("ijepa"):  # (I-JEPA has no head)
            overrides += ["model.head.out_dim=64", "model.head.hidden_dim=32", "model.head.bottleneck_dim=16"]
    else:
        overrides = [f"config={recipe}", *SMALL, *RECIPES[recipe]]
        if recipe in ("moco", "mocov3", "byol", "dino"):
            overrides += ["model.trunk=vit_tiny", *VIT]
    cfg = compose_config([*overrides, "model.trunk_kwargs.drop_path_rate=0.5"])
    torch.manual_seed(0)
    return build_model(cfg, in_channels=3).train()


@pytest.mark.parametrize("recipe", TEACHER_RECIPES + PAPER)
def test_every_teacher_is_deterministic_in_training_whatever_drop_path_the_student_has(recipe: str,
                                                                                      tmp_path: Path) -> None:
    """Two forwards of the same images through the teacher trunk are equal in train mode, the student's differ (drop
    path 0.5: 8 images x 2 residual branches of the last block draw their own masks). The paper-scale trunks see 64 px
    images (4 x 4 patches), which they take as the 224 px ones, at a thirteenth of the cost."""
    model = _model(recipe, tmp_path)
    trunks = [(s, t) for s, t in model.momentum_pairs() if s is model.trunk]
    assert trunks, f"{recipe}: no (trunk, teacher trunk) pair among the momentum pairs"
    student, teacher = trunks[0]
    size = 64 if recipe in PAPER else 32
    x = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.equal(student(x), student(x)), "the student's drop path is not on: the test tests nothing"
        assert torch.equal(teacher(x), teacher(x)), f"{recipe}: two teacher forwards of the same images differ"
    assert teacher.training  # still in train mode: nothing but the noise was switched off


def test_every_methods_model_is_an_ssl_model_with_its_teachers_named() -> None:
    """Every recipe's model is an SSLModel (trunk, head, forward, momentum_pairs), and momentum_pairs names
    exactly the frozen copies the momentum_teacher hook moves: none for the models without a teacher; the other
    frozen copy, DINOv3's Gram teacher, is among the trunk's copies (trunk_copies), which the EMA does not move."""
    from helpers import RECIPES, SMALL

    from sslkit.builder.model import build_model
    from sslkit.config.compose import compose_config
    from sslkit.models.ssl_model import SSLModel

    for recipe in RECIPES:
        cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe]])
        model = build_model(cfg, in_channels=3 if recipe == "distill" else 1)  # (the distillation's teacher: RGB)
        assert isinstance(model, SSLModel), recipe
        teachers = {id(t) for _, t in model.momentum_pairs()}
        frozen = {id(m) for m in model.children() if not any(p.requires_grad for p in m.parameters())
                  and any(True for _ in m.parameters())}
        copies = {id(c) for c in model.trunk_copies()}
        assert teachers | copies == frozen, recipe
        assert (copies - teachers != set()) == (recipe == "dinov3"), recipe
        assert bool(teachers) == ("momentum_teacher" in cfg.method.hooks), recipe
