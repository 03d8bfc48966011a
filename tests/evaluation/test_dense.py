"""The dense probe: mIoU against hand-counted pixels, the segmentation sets (the Fashion-MNIST scenes, Fashion-MNIST's
threshold, ADE20K's folder layout, and the scenes written as one), the head and its schedule, and ``sslkit dense`` on
a trained ViT run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, SMALL, ade_folder, run_main

from sslkit.data.segmentation import (
    IGNORE_INDEX,
    FashionMNISTScenes,
    FashionMNISTSegmentation,
    SegmentationFolder,
    SegmentationTransform,
    folder_classes,
    split_scenes,
    write_segmentation_folder,
)
from sslkit.evaluation.dense import LinearSegmentationHead, area_stats, dense_lr, segmentation_metrics


def test_miou_is_the_mean_over_classes_of_intersection_over_union_counted_by_hand() -> None:
    target = torch.tensor([[0, 0, 1, 1], [2, 2, 1, IGNORE_INDEX]])
    pred = torch.tensor([[0, 1, 1, 1], [2, 0, 0, 2]])
    # class 0: labelled at 2 pixels, predicted at 3 (the ignored pixel's prediction is left out), both at 1 -> 1/4
    # class 1: labelled 3, predicted 3, both 2 -> 2/4;  class 2: labelled 2, predicted 1, both 1 -> 1/2
    # class 3: neither -> no IoU (left out of the mean)
    stats = area_stats(pred, target, num_classes=4)
    assert stats[0].tolist() == [1, 2, 1, 0] and stats[3].tolist() == [2, 3, 2, 0]
    got = segmentation_metrics(stats)
    assert got["per_class_iou"] == [0.25, 0.5, 0.5, None]
    assert got["miou"] == pytest.approx((0.25 + 0.5 + 0.5) / 3)
    assert got["pixel_accuracy"] == pytest.approx(4 / 7)
    assert got["mean_accuracy"] == pytest.approx((1 / 2 + 2 / 3 + 1 / 2) / 3)
    twice = segmentation_metrics(area_stats(pred, target, 4) + area_stats(pred, target, 4))
    assert twice["miou"] == pytest.approx(got["miou"])  # summed over batches, then divided


def test_fashion_mnist_pixels_above_the_threshold_take_the_image_class() -> None:
    images = torch.zeros(2, 1, 28, 28, dtype=torch.uint8)
    images[0, 0, 5:10, 5:10] = 200
    images[0, 0, 0, 0] = 20  # 20 / 255 = 0.078: under the 0.1 threshold
    images[1, 0, 3, 4] = 30  # 0.118: over it
    data = FashionMNISTSegmentation(images, torch.tensor([3, 9]), threshold=0.1)
    image, mask = data[0]
    assert torch.equal(image, images[0]) and mask.dtype == torch.int64
    assert int(mask[5:10, 5:10].unique().item()) == 4 and int(mask.sum()) == 25 * 4  # label 3 -> class 4
    _, mask = data[1]
    assert mask[3, 4] == 10 and int((mask > 0).sum()) == 1
    with pytest.raises(ValueError, match="threshold"):
        FashionMNISTSegmentation(images, torch.tensor([3, 9]), threshold=1.5)


def _garments(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake Fashion-MNIST: image i a block of brightness 100 + i on black with a faint (10 of 255) rim, class i % 10."""
    images = torch.zeros(n, 1, 28, 28, dtype=torch.uint8)
    for i in range(n):
        images[i, 0, 4:24, 4:24] = 10
        images[i, 0, 6:22, 6:22] = 100 + i
    return images, torch.arange(n) % 10


def test_a_scene_labels_each_garments_pixels_with_its_class_and_nothing_else() -> None:
    images, labels = _garments()
    scenes = FashionMNISTScenes(images, labels, count=30, canvas=56, min_garments=2, max_garments=4, jitter=3,
                                threshold=0.1, seed=5)
    seen_counts = set()
    for i in range(len(scenes)):
        image, mask = scenes[i]
        assert image.shape == (1, 56, 56) and image.dtype == torch.uint8 and mask.shape == (56, 56)
        layout = scenes.layout(i)
        seen_counts.add(len(layout))
        assert 2 <= len(layout) <= 4 and len({c for _, c, _, _ in layout}) == len(layout)  # classes differ
        expected = torch.zeros(56, 56, dtype=torch.int64)
        for index, c, top, left in layout:
            assert int(labels[index]) == c and 0 <= top <= 28 and 0 <= left <= 28
            solid = images[index, 0] > 25  # 0.1 x 255
            expected[top:top + 28, left:left + 28][solid] = c + 1
            assert torch.equal(image[0, top:top + 28, left:left + 28][solid], images[index, 0][solid]) or \
                len(layout) > 1  # (a garment pasted later may cover part of it)
        faint = (image[0] > 0) & (image[0] <= 25) & (expected == 0)
        expected[faint] = IGNORE_INDEX
        assert torch.equal(mask, expected), i
        assert int((mask == 0).sum()) > 0 and bool((image[0][mask == 0] == 0).all())  # background is black
    assert seen_counts == {2, 3, 4}
    again = FashionMNISTScenes(images, labels, count=30, canvas=56, jitter=3, seed=5)
    assert all(torch.equal(again[i][1], scenes[i][1]) for i in (7, 3, 29))  # scene i from (seed, i) alone, any order
    other = FashionMNISTScenes(images, labels, count=30, canvas=56, jitter=3, seed=6)
    assert any(not torch.equal(other[i][1], scenes[i][1]) for i in range(5))
    with pytest.raises(ValueError, match="multiple of 28"):
        FashionMNISTScenes(images, labels, count=3, canvas=50)
    with pytest.raises(ValueError, match="garments"):
        FashionMNISTScenes(images, labels, count=3, canvas=28, min_garments=2, max_garments=2)


def test_the_scenes_written_as_a_folder_read_back_the_same(tmp_path: Path) -> None:
    images, labels = _garments()
    scenes = split_scenes(images, labels, "test", 6, canvas=56, seed=2)
    assert scenes.seed == 5  # the test split's own stream: seed x 2 + 1
    write_segmentation_folder(scenes, tmp_path / "sc", "test", {"num_classes": 11})
    folder = SegmentationFolder(tmp_path / "sc", "test")  # reduce_zero_label: 0 ignored, the others shifted down
    assert len(folder) == 6 and folder_classes(tmp_path / "sc") == 11 and folder.mismatched() == []
    for i in range(6):
        (image, mask), (read, read_mask) = scenes[i], folder[i]
        assert torch.equal(read, image.expand(3, -1, -1)) and torch.equal(read_mask, mask)


def test_sslkit_data_scenes_writes_the_scenes_dense_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sslkit.data.sources import DEBIAN_FASHION_MNIST

    if not Path(DEBIAN_FASHION_MNIST).is_dir():
        pytest.skip("no Fashion-MNIST here (apt-get install dataset-fashion-mnist)")
    from sslkit.config.compose import compose_config
    from sslkit.launch.cli import console
    from sslkit.tools.dense import segmentation_sets

    out = tmp_path / "scenes"
    assert console(["data", "scenes", f"output={out}", "train=12", "test=5", "seed=3"]) == 0
    assert "sslkit dense checkpoint=RUN eval.dense.dataset=folder" in capsys.readouterr().out
    cfg = compose_config(["eval.dense.scenes.train=12", "eval.dense.scenes.test=5", "eval.dense.scenes.seed=3"])
    train, test, classes, described = segmentation_sets(cfg)  # eval.dense.dataset=scenes, the default
    assert classes == 11 and described["dataset"] == "scenes" and len(train) == 12 and len(test) == 5
    for split, scenes in (("train", train), ("test", test)):
        folder = SegmentationFolder(out, split)
        for i in (0, len(scenes) - 1):
            assert torch.equal(folder[i][1], scenes[i][1]), (split, i)
    assert console(["data", "scenes", f"output={out}"]) == 2  # never over an earlier folder
    assert "holds images/ already" in capsys.readouterr().err


def test_a_folder_whose_class_maps_do_not_fit_their_images_is_named(tmp_path: Path) -> None:
    from PIL import Image

    from sslkit.config.compose import compose_config
    from sslkit.tools.dense import segmentation_sets
    from sslkit.tools.pretrained import ToolError

    root = ade_folder(tmp_path / "ade")
    Image.new("L", (16, 16)).save(root / "annotations" / "validation" / "ADE_0001.png")
    assert SegmentationFolder(root, "test").mismatched() == ["ADE_0001.jpg (image 32x32, map 16x16)"]
    cfg = compose_config(["eval.dense.dataset=folder", f"eval.dense.path={root}", "eval.dense.num_classes=2"])
    with pytest.raises(ToolError, match=r"ADE_0001\.jpg"):
        segmentation_sets(cfg)


def test_an_ade20k_layout_folder_reads_images_and_class_maps_with_zero_ignored(tmp_path: Path) -> None:
    root = ade_folder(tmp_path / "ade")
    train, test = SegmentationFolder(root, "train"), SegmentationFolder(root, "test")
    assert len(train) == 4 and len(test) == 2
    image, mask = train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    assert set(mask.unique().tolist()) == {0, 1, IGNORE_INDEX}  # 1 -> 0, 2 -> 1, 0 -> ignored
    assert (mask[0] == IGNORE_INDEX).all()
    raw = SegmentationFolder(root, "train", reduce_zero_label=False)[0][1]
    assert set(raw.unique().tolist()) == {0, 1, 2}
    (root / "annotations" / "validation" / "ADE_0001.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"no class map for 1 image\(s\).*ADE_0001.jpg"):
        SegmentationFolder(root, "test")
    with pytest.raises(FileNotFoundError, match="images/training/ and annotations/training/"):
        SegmentationFolder(tmp_path / "nothing", "train")


def test_the_transform_resizes_a_class_map_without_blending_labels() -> None:
    image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    mask = torch.randint(0, 5, (40, 40))
    x, m = SegmentationTransform(16, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])(image, mask)
    assert x.shape == (3, 16, 16) and m.shape == (16, 16) and m.dtype == torch.int64
    assert set(m.unique().tolist()) <= set(mask.unique().tolist())
    same = SegmentationTransform(40, mean=[0.5], std=[0.25])(image, mask)
    torch.testing.assert_close(same[0], (image.float() / 255 - 0.5) / 0.25)
    assert torch.equal(same[1], mask)


def test_the_head_and_its_schedule_are_dinov3s() -> None:
    torch.manual_seed(0)
    head = LinearSegmentationHead(64, 7)
    assert head.conv.weight.shape == (7, 64, 1, 1) and head.conv.bias.abs().sum() == 0
    assert 0.008 < head.conv.weight.std().item() < 0.012
    assert head(torch.randn(2, 64, 4, 4)).shape == (2, 7, 4, 4)
    assert dense_lr(1e-3, 0, 10, 100) == pytest.approx(1e-9)
    assert dense_lr(1e-3, 5, 10, 100) == pytest.approx(1e-3 * (1e-6 + (1 - 1e-6) * 0.5))
    assert dense_lr(1e-3, 10, 10, 100) == pytest.approx(1e-3)
    assert dense_lr(1e-3, 55, 10, 100) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert dense_lr(1e-3, 100, 10, 100) == pytest.approx(0.0, abs=1e-15)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense") / "run"
    run_main("config=dinov3", *SMALL, *RECIPES["dinov3"], "optim.max_steps=2", "eval.knn.enabled=false",
             f"output_dir={out}")
    return out


@pytest.mark.slow
def test_sslkit_dense_writes_miou_for_a_vit_run_on_an_ade20k_folder(vit_run: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from sslkit.launch.cli import console

    root = ade_folder(tmp_path / "ade", n_train=6, n_test=3)
    code = console(["dense", f"checkpoint={vit_run}", "eval.dense.dataset=folder", f"eval.dense.path={root}",
                    "eval.dense.num_classes=2", "eval.dense.epochs=2", "eval.dense.batch_size=4",
                    "machine.device=cpu"])
    assert code == 0, capsys.readouterr().err
    record = json.loads((vit_run / "eval" / "dense.json").read_text())
    assert 0.0 <= record["miou"] <= 1.0 and len(record["per_class_iou"]) == 2
    assert record["num_train"] == 6 and record["num_test"] == 3 and record["config"]["image_size"] == 32
    assert len(record["epochs"]) == 2 and all(math.isfinite(e["train_loss"]) for e in record["epochs"])


@pytest.mark.slow
def test_sslkit_dense_on_fashion_mnist_names_its_threshold(vit_run: Path, tmp_path: Path) -> None:
    from sslkit.data.sources import DEBIAN_FASHION_MNIST

    if not Path(DEBIAN_FASHION_MNIST).is_dir():
        pytest.skip("no Fashion-MNIST here (apt-get install dataset-fashion-mnist)")
    from sslkit.launch.cli import console

    out = tmp_path / "fm.json"
    # the run trained at 32 px (synthetic images): Fashion-MNIST's 28 px images are resized to it
    assert console(["dense", f"checkpoint={vit_run}", "eval.dense.dataset=fashion_mnist",
                    "eval.dense.train_samples=256", "eval.dense.epochs=1", "data.limit=128", "machine.device=cpu",
                    f"output={out}"]) == 0
    record = json.loads(out.read_text())
    assert record["num_classes"] == 11 and record["config"]["threshold"] == 0.1
    assert record["num_train"] == record["num_test"] == 128  # data.limit, as every tool reads it
    assert 0.0 <= record["miou"] <= 1.0


@pytest.mark.slow
def test_sslkit_dense_on_the_scenes_reads_them_through_the_runs_own_window(vit_run: Path, tmp_path: Path) -> None:
    from sslkit.data.sources import DEBIAN_FASHION_MNIST

    if not Path(DEBIAN_FASHION_MNIST).is_dir():
        pytest.skip("no Fashion-MNIST here (apt-get install dataset-fashion-mnist)")
    from sslkit.launch.cli import console

    found = {}
    for cache_gb in ("4", "0"):  # the maps extracted once, or read by the trunk every epoch: the same protocol
        out = tmp_path / f"scenes{cache_gb}.json"
        assert console(["dense", f"checkpoint={vit_run}", "eval.dense.scenes.train=16", "eval.dense.scenes.test=8",
                        "eval.dense.epochs=2", "eval.dense.batch_size=8", f"eval.dense.cache_gb={cache_gb}",
                        "machine.device=cpu", f"output={out}"]) == 0
        found[cache_gb] = json.loads(out.read_text())
    for record in found.values():
        # 56 px scenes, a run trained at 32 px: windows of 32 px at 0 and 24 on each side
        assert record["config"]["dataset"] == "scenes" and record["config"]["image_size"] == 56
        assert record["config"]["window"] == 32 and record["num_train"] == 16 and record["num_test"] == 8
        assert 0.0 <= record["miou"] <= 1.0 and len(record["epochs"]) == 2
    assert found["4"]["epochs"][0]["train_loss"] == pytest.approx(found["0"]["epochs"][0]["train_loss"], rel=0.2)


def test_sslkit_dense_refuses_a_cnn_run_and_a_folder_without_its_path(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from sslkit.launch.cli import console

    out = tmp_path / "cnn"
    run_main("config=simclr", *SMALL, "optim.max_steps=1", "eval.knn.enabled=false", f"output_dir={out}")
    assert console(["dense", f"checkpoint={out}", "machine.device=cpu"]) == 2
    assert "sslkit dense reads a ViT's patch tokens, and model.trunk=small_cnn gives none" in capsys.readouterr().err


def test_larger_images_are_read_window_by_window_and_overlaps_averaged() -> None:
    from sslkit.evaluation.dense import window_starts, windowed_maps

    assert window_starts(56, 28) == [0, 28] and window_starts(42, 28) == [0, 14] and window_starts(28, 28) == [0]
    calls = []

    def maps_of(x: torch.Tensor) -> torch.Tensor:  # a "network" whose map depends on the whole window it sees
        calls.append(tuple(x.shape[-2:]))
        pooled = x.mean(dim=(2, 3), keepdim=True)
        return torch.nn.functional.avg_pool2d(x, 7) + pooled
    x = torch.randn(2, 3, 56, 56)
    out = windowed_maps(maps_of, x, 28, 7)
    assert calls == [(28, 28)] * 4 and out.shape == (2, 3, 8, 8)
    assert torch.allclose(out[:, :, 4:, :4], maps_of(x[:, :, 28:, :28]))  # the bottom-left window in its place
    calls.clear()
    y = torch.randn(1, 3, 42, 42)  # windows at 0 and 14 on each side: the middle patches seen by two or four
    out = windowed_maps(maps_of, y, 28, 7)
    parts = {(t, s): maps_of(y[:, :, t:t + 28, s:s + 28]) for t in (0, 14) for s in (0, 14)}
    assert out.shape == (1, 3, 6, 6)
    assert torch.allclose(out[:, :, 0, 0], parts[(0, 0)][:, :, 0, 0])
    assert torch.allclose(out[:, :, 2, 0], (parts[(0, 0)][:, :, 2, 0] + parts[(14, 0)][:, :, 0, 0]) / 2)
    assert torch.allclose(out[:, :, 3, 3], sum(p[:, :, 3 - t // 7, 3 - s // 7] for (t, s), p in parts.items()) / 4)
    assert torch.equal(windowed_maps(maps_of, x, None, 7), maps_of(x))  # no window: the whole image
    assert torch.equal(windowed_maps(maps_of, x, 56, 7), maps_of(x))
