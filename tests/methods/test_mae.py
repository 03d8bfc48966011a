"""MAE: patchify and the loss against loops over patches, the decoder's restoring of positions, the model's wiring."""

from __future__ import annotations

import pytest
import torch

from sslkit.methods.mae import MAELoss, build_mae, mae_loss, patchify
from sslkit.models.masking import RandomMasking, SampleKeys
from sslkit.models.vit import build_vit


def test_patchify_puts_each_patchs_pixels_in_row_column_channel_order() -> None:
    x = torch.randn(2, 3, 8, 12)
    p = 4
    got = patchify(x, p)
    assert got.shape == (2, 6, 48)
    for b in range(2):
        for n in range(6):
            i, j = divmod(n, 3)  # raster order over a 2 x 3 grid
            for r in range(p):
                for c in range(p):
                    for ch in range(3):
                        assert got[b, n, (r * p + c) * 3 + ch] == x[b, ch, i * p + r, j * p + c]


def _reference(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, norm_pix: bool) -> float:
    """MAE's forward_loss with loops: per patch, (optionally) normalise the target with its mean and unbiased
    variance, the mean squared error over its pixels; the mean over masked patches of the whole batch."""
    total, count = 0.0, 0.0
    b_, n_, p_ = pred.shape
    for b in range(b_):
        for n in range(n_):
            t = [float(v) for v in target[b, n]]
            if norm_pix:
                mean = sum(t) / p_
                var = sum((v - mean) ** 2 for v in t) / (p_ - 1)
                t = [(v - mean) / (var + 1e-6) ** 0.5 for v in t]
            err = sum((float(pred[b, n, k]) - t[k]) ** 2 for k in range(p_)) / p_
            total += err * float(mask[b, n])
            count += float(mask[b, n])
    return total / count


@pytest.mark.parametrize("norm_pix", [True, False])
def test_loss_matches_maes_forward_loss_patch_by_patch(norm_pix: bool) -> None:
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 10, 12, generator=g), torch.randn(3, 10, 12, generator=g) * 3 + 1
    mask = RandomMasking(0.6)(SampleKeys(0, 0, torch.arange(3)), (2, 5)).mask  # 6 of 10 masked in every image
    got = mae_loss(pred, target, mask, norm_pix).item()
    assert got == pytest.approx(_reference(pred, target, mask, norm_pix), rel=1e-5)


def test_only_masked_patches_count_and_normalised_targets_ignore_each_patchs_scale() -> None:
    g = torch.Generator().manual_seed(1)
    pred = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    target = torch.randn(2, 6, 8, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    mae_loss(pred, target, mask).backward()
    assert (pred.grad[~mask] == 0).all() and (pred.grad[mask].abs().sum(-1) > 0).all()
    rescaled = target * torch.rand(2, 6, 1, generator=g).add(0.5) + torch.randn(2, 6, 1, generator=g)
    assert mae_loss(pred, rescaled, mask).item() == pytest.approx(mae_loss(pred, target, mask).item(), rel=1e-4)


def _model(decoder_depth: int = 1):
    torch.manual_seed(0)
    trunk = build_vit("vit_tiny", 1, 16, 4, depth=1, num_heads=3, pos_embed="sincos")
    return build_mae(trunk, None, decoder_dim=32, decoder_depth=decoder_depth, decoder_heads=2)


def test_the_model_encodes_kept_patches_and_decodes_every_patch_in_place() -> None:
    model = _model()
    x = torch.randn(4, 1, 16, 16)
    masks = RandomMasking(0.75)(SampleKeys(0, 0, torch.arange(4)), (4, 4))
    out = model([x], masks=[masks])
    assert out.tokens[0].patches.shape == (4, 4, 192)  # the encoder saw the 4 kept patches only
    assert out.predictions[0].shape == (4, 16, 16) and torch.equal(out.targets[0], patchify(x, 4))
    # with no decoder blocks, each position's output depends on its own token only: a kept patch's prediction is
    # pred(norm(embed(its encoder token) + pos)), a masked one's pred(norm(mask token + pos)), each at its place
    flat = _model(decoder_depth=0)
    out = flat([x], masks=[masks])
    d = flat.decoder
    for b in range(4):
        for slot, n in enumerate(masks.keep[b].tolist()):
            expected = d.pred(d.norm(d.embed(out.tokens[0].patches[b, slot]) + d.pos_embed[0, n]))
            assert torch.allclose(out.predictions[0][b, n], expected, atol=1e-5)
        for n in torch.nonzero(masks.mask[b]).flatten().tolist():
            expected = d.pred(d.norm(d.mask_token[0, 0] + d.pos_embed[0, n]))
            assert torch.allclose(out.predictions[0][b, n], expected, atol=1e-5)


def test_the_loss_reads_the_models_masks_and_the_encoder_gets_gradient() -> None:
    model = _model()
    x = torch.randn(4, 1, 16, 16)
    masks = RandomMasking(0.75)(SampleKeys(0, 0, torch.arange(4)), (4, 4))
    out = model([x], masks=[masks])
    loss = MAELoss()(out, {})
    assert loss.item() == pytest.approx(mae_loss(out.predictions[0], out.targets[0], masks.mask).item())
    loss.backward()
    assert model.trunk.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.trunk.pos_embed.grad is None  # fixed sine-cosine embeddings
    with pytest.raises(ValueError, match=r"masking\.name=random"):
        MAELoss()(model([x]), {})
    with pytest.raises(ValueError, match="needs a ViT trunk"):
        build_mae(torch.nn.Linear(3, 3))
