"""Tests for the augmentation builders (simclr, eval) and their torch-RNG-only randomness."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from sslkit.data import transforms as T
from sslkit.data.transforms import build_transform
from sslkit.registry import UnknownNameError


def image(c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (c, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("c", "h", "w", "size", "views"), [(1, 28, 28, 28, 2), (3, 32, 32, 24, 3), (3, 30, 45, 16, 1)])
def test_simclr_shapes_and_views_differ(c: int, h: int, w: int, size: int, views: int) -> None:
    t = build_transform("simclr", image_size=size, num_views=views)
    img = image(c, h, w)
    out = t(img)
    assert isinstance(out, list) and len(out) == views
    for v in out:
        assert v.shape == (c, size, size) and v.dtype == torch.float32
        assert v.min() >= -1.0 - 1e-6 and v.max() <= 1.0 + 1e-6  # default mean = std = 0.5
    if views > 1:
        assert not torch.equal(out[0], out[1])
    assert torch.equal(img, image(c, h, w))  # input untouched


def test_simclr_randomness_comes_only_from_torch() -> None:
    t = build_transform("simclr", image_size=20, blur_p=0.5, solarize_p=0.5)
    img = image(3, 24, 24)
    torch.manual_seed(5)
    a = t(img)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(5)
    b = t(img)
    torch.manual_seed(6)
    c = t(img)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_full_crop_and_flip_are_exact() -> None:
    img = image(3, 9, 9)
    kw = dict(
        image_size=9,
        num_views=1,
        crop_scale=(1.0, 1.0),
        crop_ratio=(1.0, 1.0),
        jitter_strength=0.0,
        grayscale_p=0.0,
        mean=[0.0],
        std=[1.0],
    )
    (same,) = build_transform("simclr", hflip_p=0.0, **kw)(img)
    (flipped,) = build_transform("simclr", hflip_p=1.0, **kw)(img)
    torch.testing.assert_close(same, img.float() / 255)
    torch.testing.assert_close(flipped, img.flip(-1).float() / 255)


def test_grayscale_and_solarize_always_on() -> None:
    t = build_transform("simclr", image_size=16, num_views=4, grayscale_p=1.0, solarize_p=1.0, mean=[0.0], std=[1.0])
    for v in t(image(3, 16, 16)):
        assert torch.equal(v[0], v[1]) and torch.equal(v[1], v[2])
        assert v.max() <= 0.5 + 1e-6  # solarized: nothing stays above the threshold


def test_normalisation_uses_mean_and_std() -> None:
    kw = dict(
        image_size=8,
        num_views=1,
        crop_scale=(1.0, 1.0),
        crop_ratio=(1.0, 1.0),
        hflip_p=0.0,
        jitter_strength=0.0,
        grayscale_p=0.0,
    )
    img = image(3, 8, 8)
    (v,) = build_transform("simclr", mean=[0.1, 0.2, 0.3], std=[0.5, 0.25, 2.0], **kw)(img)
    expected = (img.float() / 255 - torch.tensor([0.1, 0.2, 0.3]).view(3, 1, 1)) / torch.tensor([0.5, 0.25, 2.0]).view(
        3, 1, 1
    )
    torch.testing.assert_close(v, expected)
    with pytest.raises(ValueError, match="3 values but the image has 1 channel"):
        build_transform("simclr", mean=[0.1, 0.2, 0.3], std=[1.0], **kw)(image(1, 8, 8))


def test_one_channel_jitter_only_brightness_and_contrast() -> None:
    t = build_transform("simclr", image_size=28, num_views=8, jitter_strength=1.0, blur_p=1.0)
    views = t(image(1, 28, 28))
    assert all(v.shape == (1, 28, 28) for v in views)
    assert all(torch.isfinite(v).all() for v in views)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="crop_scale"):
        build_transform("simclr", image_size=8, crop_scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="blur_p"):
        build_transform("simclr", image_size=8, blur_p=1.5)
    with pytest.raises(UnknownNameError, match="simclr"):
        build_transform("simclrr", image_size=8)


@pytest.mark.parametrize("shift", [-0.5, -0.13, 0.0, 0.07, 0.31, 0.5])
def test_hue_shift_matches_torchvision(shift: float) -> None:
    x = torch.rand(3, 11, 13, generator=torch.Generator().manual_seed(1))
    x[:, 0, 0] = 0.4  # gray pixel (no hue)
    x[:, 0, 1] = torch.tensor([0.7, 0.7, 0.1])  # tie between two maxima
    torch.testing.assert_close(T._shift_hue(x, shift), TF.adjust_hue(x, shift), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("k", "sigma", "h", "w"), [(3, 0.4, 28, 28), (5, 1.7, 12, 20), (23, 2.0, 40, 17)])
def test_blur_matches_torchvision(k: int, sigma: float, h: int, w: int) -> None:
    x = torch.rand(3, h, w, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        T._gaussian_blur(x, k, sigma), TF.gaussian_blur(x, [k, k], [sigma, sigma]), atol=1e-5, rtol=0
    )


def test_crop_box_stays_inside_and_respects_scale() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        u = torch.rand(40, generator=g, dtype=torch.float64).tolist()
        top, left, h, w = T.random_resized_crop_box(u, 30, 50, (0.2, 0.6), (0.75, 4 / 3))
        assert 0 <= top and top + h <= 30 and 0 <= left and left + w <= 50
        assert 0.15 * 1500 <= h * w <= 0.7 * 1500


def test_eval_transform_resize_and_center_crop() -> None:
    img = image(3, 40, 60)
    t = build_transform("eval", image_size=16, resize=20)
    (a,) = t(img)
    (b,) = t(img)
    assert a.shape == (3, 16, 16) and torch.equal(a, b)
    ref = TF.center_crop(TF.resize(img.float() / 255, [20], antialias=True), [16, 16])
    torch.testing.assert_close(a, (ref - 0.5) / 0.5, atol=2e-3, rtol=0)


def test_eval_transform_no_resize() -> None:
    img = image(1, 28, 28)
    (same,) = build_transform("eval", image_size=28, mean=[0.0], std=[1.0])(img)
    torch.testing.assert_close(same, img.float() / 255)
    (crop,) = build_transform("eval", image_size=20, mean=[0.0], std=[1.0])(img)
    torch.testing.assert_close(crop, img[:, 4:24, 4:24].float() / 255)
    (up,) = build_transform("eval", image_size=32)(img)  # smaller image: upscaled, not padded
    assert up.shape == (1, 32, 32) and (up > -1).float().mean() > 0.9


@pytest.mark.parametrize("preset", ["folder", "filelist"])
def test_the_evaluation_crop_of_a_folder_follows_data_image_size(tmp_path, preset: str) -> None:
    """``config=dino_vit data=folder data.image_size=64``: the evaluation crop keeps 64 of 73 px (crop_pct 0.875), not
    the centre 16 px of a 256 px upscale (the folder preset's resize of 224 px runs). A bright square near the
    image's corner and one at its centre are both in the crop, where the 73 px resize puts them."""
    from sslkit.config.compose import compose_config

    source = ["data=folder", f"data.train.path={tmp_path}"] if preset == "folder" else [
        "data=filelist", f"data.train.path={tmp_path / 'list.txt'}"]
    if preset == "filelist":
        (tmp_path / "list.txt").write_text("a.jpg\n")
    (tmp_path / "a.jpg").touch()  # the folder check looks for an image file
    cfg = compose_config(["config=dino_vit", *source, "data.image_size=64", "data.small_image_size=32",
                          "model.trunk_kwargs.patch_size=16", "machine.device=cpu"])
    spec = dict(cfg.data.eval_transform)
    assert spec["image_size"] == 64 and T.eval_resize(64, spec.get("resize"), spec.get("crop_pct")) == 73
    image = torch.zeros(3, 64, 64, dtype=torch.uint8)
    image[:, 6:12, 6:12] = 255  # near the corner: 6.8-13.7 px after the 73 px resize, 2.8-9.7 in the crop
    image[:, 30:34, 30:34] = 255  # the centre: 34.2-38.8 after the resize, 30.2-34.8 in the crop
    view = build_transform(**spec)(image)[0]
    assert view.shape == (3, 64, 64)
    pixels = view * 0.5 + 0.5  # sslkit's default normalisation (0.5, 0.5)
    assert pixels[:, 4:9, 4:9].min() > 0.9 and pixels[:, 31:34, 31:34].min() > 0.9
    assert pixels[:, 14:28, 14:28].max() < 0.05 and pixels[:, 45:, 45:].max() < 0.05
    # the paper-scale size keeps the usual 224 of 256
    assert T.eval_resize(224, None, spec.get("crop_pct")) == 256


def test_an_explicit_resize_that_crops_away_more_than_usual_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    T._WARNED.clear()
    with caplog.at_level("WARNING", logger="sslkit.data.transforms"):
        assert T.eval_resize(64, 256) == 256 and T.eval_resize(64, 256) == 256
        assert T.eval_resize(224, 256) == 256 and T.eval_resize(64, 73) == 73  # the usual share: no warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "keeps 25% of their side" in warnings[0] and "data.eval_transform.resize=null" in \
        warnings[0], warnings
    with pytest.raises(ValueError, match="crop_pct"):
        T.eval_resize(64, None, 1.5)
