"""The ViT recipes on 2 gloo ranks with batch B train like 1 process with batch 2B: same masks, same update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_workers import distill_teacher_shards, recipe_states, run_ranks

pytestmark = pytest.mark.multiprocess

NEW = ["mae", "lejepa", "dino_vit", "mocov3_vit", "simclr_vit", "ibot", "dinov2", "ijepa"]
#: dinov3 with KoLeo off (docs/vit.md), and so with a high-resolution phase from its second update (its crops drawn
#: per update, the Gram teacher's crops at their own size)
DINOV3 = ["dinov3-nokoleo", "dinov3-hires"]
#: distillation with two students (a CNN with BatchNorm, synced, and a ViT) on one teacher forward a step; and a ViT
#: student alone, which fsdp shards with the teacher (distill.teacher_shard=auto)
DISTILL = ["distill-two", "distill-vit"]


#: Plain SGD: the update is -lr x the all-reduced gradient, so the states compare the gradients themselves. With
#: the recipes' AdamW, which divides each gradient by its own running magnitude, the rounding differences of
#: near-zero gradient components grow to a fraction of the lr: measured after 2 updates, 99.9% of the elements
#: within 4e-8 of one process's and at most 5e-5 (lejepa, lr 5e-4) for a few.
SGD = ["optim.name=sgd", "optim.momentum=0.0", "optim.weight_decay=0.0", "optim.lr=0.05", "optim.lr_scaling=none",
       "optim.final_weight_decay=null"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Each recipe's state after 2 SGD updates of batch 16 in one process: what 2 ranks of batch 8 must reach, under
    ddp and under fsdp (dinov3 with KoLeo off included)."""
    return recipe_states(0, 1, [*NEW, *DINOV3, *DISTILL], 16, 2, str(tmp_path_factory.mktemp("one")), *SGD)


def test_two_ranks_train_each_vit_recipe_like_one_process(tmp_path: Path,
                                                          one_process: dict[str, dict[str, torch.Tensor]]) -> None:
    """Two updates of every new recipe (masks drawn per sample on each rank, SIGReg's all-reduced statistics,
    DINO's centre, MoCo v3's gathered keys, teachers, synced BatchNorm in the projectors), and dinov3 (timm's
    DINOv3 trunk, the Gram teacher a snapshot before the second update, KoLeo off: docs/vit.md; and with the second
    update in a high-resolution phase, each rank cropping its half of the batch at the size drawn for the update,
    the Gram teacher on its own larger crops). A ViT has no
    BatchNorm (the projectors' is synced), so the states agree to float rounding: measured max difference 1.5e-8
    (mae) to 1.6e-6 (simclr_vit, whose projector has BatchNorm), 1.5e-8 (dinov3, Gram teacher included), tolerance
    5e-6."""
    recipes, single = [*NEW, *DINOV3, *DISTILL], one_process
    ranks = run_ranks(recipe_states, 2, str(tmp_path / "two"), recipes, 8, 2, str(tmp_path / "two"), *SGD)
    for recipe in recipes:
        ref = single[recipe]
        assert ranks[0][recipe].keys() == ref.keys()
        worst = 0.0
        for key, value in ref.items():
            assert torch.equal(ranks[0][recipe][key], ranks[1][recipe][key]), (recipe, key)  # ranks agree exactly
            if value.is_floating_point():
                diff = (ranks[0][recipe][key].double() - value.double()).abs().max().item()
                worst = max(worst, diff)
                assert diff < 5e-6, (recipe, key, diff)
            else:
                assert torch.equal(ranks[0][recipe][key], value), (recipe, key)
        moved = [k for k in ref if "trunk.blocks.0.attn.qkv.weight" in k]  # (a distillation's: its ViT student's)
        assert moved, recipe
        print(f"{recipe}: max |2 ranks - 1 process| over the state after 2 updates: {worst:.2e}")


def test_fsdp_on_two_ranks_trains_each_vit_recipe_like_one_process(tmp_path: Path,
                                                                  one_process: dict[str, dict[str, torch.Tensor]]
                                                                  ) -> None:
    """The same under distributed.strategy=fsdp: every ViT recipe's blocks, trunks and root sharded over the 2
    ranks (teachers, decoders and predictors too; a distillation's frozen teacher as its own FSDP root), the whole
    state gathered onto rank 0 after 2 SGD updates, equal to one process's with the doubled batch within the same
    tolerance."""
    single = one_process
    sharded = [*NEW, "distill-vit"]
    ranks = run_ranks(recipe_states, 2, str(tmp_path / "two"), sharded, 8, 2, str(tmp_path / "two"), *SGD,
                      "distributed.strategy=fsdp")
    for recipe in sharded:
        ref, got = single[recipe], ranks[0][recipe]
        assert got.keys() == ref.keys(), recipe
        assert not any(k.startswith("model.") for k in ranks[1][recipe])  # gathered onto rank 0 only
        for key, value in ref.items():
            if value.is_floating_point():
                diff = (got[key].double() - value.double()).abs().max().item()
                assert diff < 5e-6, (recipe, key, diff)
            else:
                assert torch.equal(got[key], value), (recipe, key)


def test_fsdp_shards_a_distillations_vit_teacher_which_gives_each_rank_the_whole_features(tmp_path: Path) -> None:
    """distill.teacher_shard=auto under fsdp: each rank holds about half of the teacher's elements (its blocks and
    trunk sharded; the small heads it has none), and the teacher's forward gathers them: both ranks compute the
    same features of the same images, those the teacher computes whole in one process."""
    from safetensors.torch import load_file

    from sslkit import registry as R
    from sslkit.launch.doctor import SMALL_TEACHER

    ranks = run_ranks(distill_teacher_shards, 2, str(tmp_path / "two"), str(tmp_path / "two"))
    assert all(r["sharded"] for r in ranks)
    assert all(r["local"] < 0.6 * r["total"] for r in ranks), [(r["local"], r["total"]) for r in ranks]
    whole = R.get(R.TRUNKS, "vit_tiny")(in_channels=3, img_size=32, patch_size=8, depth=2, num_heads=2).eval()
    whole.load_state_dict(load_file(SMALL_TEACHER))
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = whole(x)
    for r in ranks:
        assert torch.allclose(r["pooled"], expected, atol=1e-5), (r["pooled"] - expected).abs().max()
