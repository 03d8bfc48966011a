"""The batched device augmentation against the per-image CPU transform: same uniforms, same parameters, same pixels."""

from __future__ import annotations

import math

import pytest
import torch

from sslkit.data.device_augment import UNIFORMS_PER_VIEW, DeviceSimCLRAugment, crop_boxes, device_augment_for
from sslkit.data.transforms import SimCLRTransform, build_eval, build_multicrop, random_resized_crop_box

ALL_ON = {"jitter_strength": 0.5, "jitter_p": 0.8, "grayscale_p": 0.3, "blur_p": 0.5, "solarize_p": 0.4}


@pytest.mark.parametrize(("height", "width", "scale", "ratio"), [
    (28, 28, (0.2, 1.0), (3 / 4, 4 / 3)),
    (375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
    (40, 12, (0.9, 1.0), (2.0, 3.0)),  # no attempt fits a wide box in a tall image: the centred fallback
    (12, 40, (0.5, 1.0), (0.2, 0.3)),
])
def test_crop_boxes_equal_the_per_image_boxes(height: int, width: int, scale: tuple, ratio: tuple) -> None:
    u = torch.rand(2000, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = crop_boxes(u, height, width, scale, ratio).tolist()
    expected = [list(random_resized_crop_box(row, height, width, scale, ratio)) for row in u.tolist()]
    assert got == expected


def test_crop_area_and_aspect_follow_scale_and_ratio() -> None:
    """Area fraction uniform in `scale` and log aspect ratio uniform in `ratio` (accepted draws): the means of
    20,000 boxes of a 224-pixel image against the exact means of the truncated distributions (tolerance 0.01)."""
    u = torch.rand(20000, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    top, left, h, w = crop_boxes(u, 224, 224, (0.08, 1.0), (3 / 4, 4 / 3)).double().unbind(1)
    assert ((top >= 0) & (left >= 0) & (top + h <= 224) & (left + w <= 224)).all()
    area = h * w / 224**2
    assert area.min() >= 0.07 and area.max() <= 1.0
    log_aspect = torch.log(w / h)
    assert log_aspect.abs().max() <= math.log(4 / 3) + 0.02
    assert log_aspect.mean().item() == pytest.approx(0.0, abs=0.01)  # symmetric in log space
    # large areas with extreme aspects do not fit and are redrawn, so the mean area sits below (0.08 + 1) / 2
    assert 0.45 < area.mean().item() < 0.54


def _same_uniforms(n: int, seed: int, width: int = UNIFORMS_PER_VIEW) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.stack([torch.rand(width, dtype=torch.float64) for _ in range(n)])


def _cpu_views(transform: SimCLRTransform, images: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # one torch.rand(54) per view: the uniforms of _same_uniforms, in order
    return torch.stack([transform.view(img) for img in images])


@pytest.mark.parametrize(("channels", "per_channel"), [(3, False), (1, False), (4, True), (3, True), (1, True)])
def test_every_pixel_operation_matches_the_per_image_transform(channels: int, per_channel: bool) -> None:
    """Crop geometry fixed to the whole image (scale and ratio 1), so the only resampling is the identity: flip,
    jitter in per-sample random order (brightness and contrast per channel with ``jitter_per_channel``),
    grayscale, per-sample blur, solarisation and normalisation give the per-image transform's pixels (up to float
    rounding) for the same uniforms."""
    images = torch.randint(0, 256, (96, channels, 16, 16), generator=torch.Generator().manual_seed(2),
                           dtype=torch.uint8)
    kwargs = {"image_size": 16, "crop_scale": (1.0, 1.0), "crop_ratio": (1.0, 1.0), **ALL_ON,
              "jitter_per_channel": per_channel}
    transform = SimCLRTransform(**kwargs)
    assert transform.uniforms(channels) == UNIFORMS_PER_VIEW + (2 * channels if per_channel else 0)
    cpu = _cpu_views(transform, images, seed=3)
    device = DeviceSimCLRAugment(**kwargs).views(images, _same_uniforms(len(images), 3, transform.uniforms(channels)))
    assert device.shape == cpu.shape and device.dtype == torch.float32
    assert (device - cpu).abs().max().item() < 1e-4


@pytest.mark.parametrize("listed", [False, True], ids=["batch", "list of sizes"])
def test_uniforms_of_another_width_are_refused_before_the_crop(listed: bool) -> None:
    """Uniforms drawn for another channel count or setting (the per-channel jitter's 2 a channel missing) are
    refused by name and count, for a batch and for a list of images of many sizes, before the crop reads them."""
    augment = DeviceSimCLRAugment(image_size=8, **ALL_ON, jitter_per_channel=True)
    images = torch.randint(0, 256, (4, 4, 12, 12), dtype=torch.uint8)
    given = list(images[:, :, : 10 + listed]) if listed else images  # (each a [4, H, 12] image in the list)
    with pytest.raises(ValueError, match=rf"^{UNIFORMS_PER_VIEW} uniforms per view for 4-channel images: this "
                                         rf"augmentation draws {UNIFORMS_PER_VIEW + 8}$"):
        augment.views(given, _same_uniforms(4, 0))
    assert augment.views(given, _same_uniforms(4, 0, UNIFORMS_PER_VIEW + 8)).shape == (4, 4, 8, 8)


def test_resized_crops_are_close_to_the_per_image_resize() -> None:
    """With real crops the batched roi_align resize differs from the per-image interpolation only at crop borders
    and by its box filter where a crop shrinks: on a smooth image the difference is small (in [0, 1] units before
    normalisation: std 0.5, so x2 after it). Measured: mean 0.0004, largest 0.004 (on uniform noise, the worst
    case for a box filter against an antialiasing one, mean 0.015)."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 64), torch.linspace(0, 1, 64), indexing="ij")
    smooth = torch.stack([xx, yy, (xx + yy) / 2]).mul(255).round().to(torch.uint8)
    images = smooth.expand(64, -1, -1, -1).contiguous()
    kwargs = {"image_size": 32, "jitter_strength": 0.0, "grayscale_p": 0.0}
    cpu = _cpu_views(SimCLRTransform(**kwargs), images, seed=4)
    device = DeviceSimCLRAugment(**kwargs).views(images, _same_uniforms(len(images), seed=4))
    diff = (device - cpu).abs() / 2
    assert diff.mean().item() < 0.002 and diff.max().item() < 0.02


def test_same_generator_same_views_and_views_differ() -> None:
    images = torch.randint(0, 256, (8, 3, 20, 20), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    augment = DeviceSimCLRAugment(image_size=16, **ALL_ON)
    a = augment(images, torch.Generator().manual_seed(7))
    b = augment(images, torch.Generator().manual_seed(7))
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], a[1])  # the two views of a batch are drawn independently
    assert not torch.equal(a[0], augment(images, torch.Generator().manual_seed(8))[0])


def test_multicrop_device_version_gives_every_group_in_order() -> None:
    """DINO-style multi-crop: 2 global crops (asymmetric blur and solarize) then 3 local ones at their own size.
    With the crop geometry fixed (and the local crops at the full size too, so nothing is resampled), each view
    equals the per-image group's view for the same uniforms, drawn one [N, 54] block per view, group after
    group."""
    images = torch.randint(0, 256, (16, 3, 16, 16), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    shapes = device_augment_for(build_multicrop(16, 8, num_large=2, num_small=3))(images, torch.Generator())
    assert [tuple(v.shape) for v in shapes] == [(16, 3, 16, 16)] * 2 + [(16, 3, 8, 8)] * 3
    multicrop = build_multicrop(16, 16, num_large=2, num_small=3, crop_scale=(1.0, 1.0), small_scale=(1.0, 1.0),
                                blur_p=[1.0, 0.1], solarize_p=[0.0, 0.2], small_blur_p=0.5)
    for group in multicrop.groups:
        group.crop_ratio = (1.0, 1.0)
    views = device_augment_for(multicrop)(images, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    for view, group in zip(views, [multicrop.groups[0], multicrop.groups[1], *[multicrop.groups[2]] * 3],
                           strict=True):
        u = torch.rand(16, UNIFORMS_PER_VIEW, generator=gen, dtype=torch.float64)
        expected = torch.stack([_view_from(group, img, row) for img, row in zip(images, u, strict=True)])
        assert (view - expected).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="EvalTransform has no device version yet"):
        device_augment_for(build_eval(16))


def _view_from(transform: SimCLRTransform, image: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """The per-image view of ``image`` drawn from the uniforms ``row`` (the transform draws them from torch.rand)."""
    original = torch.rand
    torch.rand = lambda *args, **kwargs: row.clone()  # type: ignore[assignment]
    try:
        return transform.view(image)
    finally:
        torch.rand = original


# ------------------------------------------------------------------------------ data.augment_on=device in runs
def _run(*args: str) -> object:
    from helpers import SMALL, run_main

    return run_main(*SMALL, "eval.knn.enabled=false", "log.tensorboard=false", "data.augment_on=device", *args,
                    check=False)


@pytest.mark.parametrize("recipe", ["simclr", "byol", "swav", "dino"])
def test_recipes_train_with_the_batch_augmented_on_the_device(tmp_path, recipe: str) -> None:
    from helpers import RECIPES, metrics

    proc = _run(f"config={recipe}", *RECIPES[recipe], "optim.max_steps=2", "log.every_n_steps=1",
                f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert "augmented on the training device" in proc.stdout and "augment" in proc.stdout  # the log and the timer
    losses = [r["loss"] for r in metrics(tmp_path / "run") if r.get("phase") == "train" and "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("recipe", ["simclr", "dino"])
def test_device_augmentation_resumes_bit_identically(tmp_path, recipe: str) -> None:
    """The generator is seeded from the clock's position: a run crashed after step 5 and resumed from the
    checkpoint of step 3 ends bit-identical to an uninterrupted one (nothing of the augmentation is saved)."""
    import reliability_helpers
    from helpers import RECIPES

    args = [f"config={recipe}", *RECIPES[recipe], "optim.epochs=2", "checkpoint.every_n_steps=3",
            "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0", "imports=[sslkit_faults]"]
    ref, out = tmp_path / "ref", tmp_path / "crashed"
    assert _run(*args, "hooks=[{name: fault_crash, step: 1000}]", f"output_dir={ref}").returncode == 0
    with pytest.raises(RuntimeError, match="injected crash after step 5"):
        _run(*args, "hooks=[{name: fault_crash, step: 5}]", f"output_dir={out}")
    assert _run(*args, "hooks=[{name: fault_crash, step: 5}]", f"output_dir={out}").returncode == 0
    expected, got = reliability_helpers.latest_state(ref), reliability_helpers.latest_state(out)
    assert expected["position"]["step"] == 8
    reliability_helpers.assert_identical(got, expected)


@pytest.mark.parametrize(("channels", "per_channel"), [(3, False), (4, True)])
def test_device_pipeline_gives_each_sample_the_workers_augmentation(channels: int, per_channel: bool) -> None:
    """Each sample's uniforms are drawn in the worker from (seed, epoch, index) as the per-image transform draws
    them: with the crop geometry fixed to the whole image (no resampling), the device views of a batch are the
    workers pipeline's views of the same samples, whatever batch they land in (a factor per channel too)."""
    from sslkit.data import SSLDataset
    from sslkit.data.device_augment import ReadForDevice
    from sslkit.data.device_decode import collate_raw
    from sslkit.data.loader import collate_views
    from sslkit.data.sources import build_synthetic

    source = build_synthetic("train", num_samples=16, image_size=24, channels=channels)
    transform = SimCLRTransform(24, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), **ALL_ON,
                                jitter_per_channel=per_channel)
    augment = device_augment_for(transform)
    workers = SSLDataset(source, transform, seed=7)
    device = SSLDataset(source, ReadForDevice(augment.num_views, augment.per_channel), seed=7)
    for indices in ([3, 0, 9, 12], [12, 5]):  # sample 12 in two different batches
        batch = collate_views([device[(2, i)] for i in indices], stack=collate_raw)
        views = augment.apply(batch["input"][0], batch["input"][1])
        for row, i in enumerate(indices):
            expected = workers[(2, i)]["views"]
            for v, view in enumerate(views):
                torch.testing.assert_close(view[row], expected[v], rtol=0, atol=2e-5)
