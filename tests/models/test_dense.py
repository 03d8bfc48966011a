"""Features per location of every trunk kind, one forward with the pooled ones, and the deterministic bilinear
resize checked against PyTorch's own interpolation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sslkit import registry as R
from sslkit.models.dense import dense_features, has_feature_map, map_channels, resize_bilinear


@pytest.mark.parametrize(("size", "out"), [((4, 4), (14, 14)), ((7, 7), (14, 14)), ((14, 14), (4, 4)),
                                           ((3, 5), (7, 2)), ((1, 1), (4, 4))])
def test_the_resize_is_torchs_bilinear_interpolation_and_its_gradient_too(size: tuple[int, int],
                                                                          out: tuple[int, int]) -> None:
    x = torch.randn(2, 3, *size, dtype=torch.float64, requires_grad=True)
    mine = resize_bilinear(x, out)
    theirs = F.interpolate(x, size=out, mode="bilinear", align_corners=False)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
    g = torch.randn_like(mine)
    (a,) = torch.autograd.grad(mine, x, g)
    (b,) = torch.autograd.grad(theirs, x, g)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_each_trunk_kind_gives_its_pooled_features_and_its_map_in_one_forward() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    cnn = R.get(R.TRUNKS, "small_cnn")(in_channels=3, width=8).eval()
    out = dense_features(cnn, x)
    torch.testing.assert_close(out.pooled, cnn(x))
    assert out.map.shape == (2, 8, 8, 64) and map_channels(cnn) == 64  # 3 stride-2 blocks: 64 / 8; 8 x width
    rn = R.get(R.TRUNKS, "resnet18")(in_channels=3).eval()
    out = dense_features(rn, x)
    torch.testing.assert_close(out.pooled, rn(x))
    body = torch.nn.Sequential(rn.conv1, rn.bn1, rn.relu, rn.maxpool, rn.layer1, rn.layer2, rn.layer3, rn.layer4)
    torch.testing.assert_close(out.map, body(x).permute(0, 2, 3, 1))
    assert map_channels(rn) == 512
    vit = R.get(R.TRUNKS, "vit_tiny")(in_channels=3, img_size=64, patch_size=16, depth=1, num_heads=2).eval()
    out = dense_features(vit, x)
    tokens = vit.forward_tokens(x)
    torch.testing.assert_close(out.pooled, vit(x))
    torch.testing.assert_close(out.map, tokens.patches.reshape(2, 4, 4, -1))
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, 4))
    assert not has_feature_map(mlp) and all(has_feature_map(t) for t in (cnn, rn, vit))
    with pytest.raises(ValueError, match="gives no features per location"):
        dense_features(mlp, x)
