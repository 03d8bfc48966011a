"""Any number of channels and 16 bits: .npy and TIFF files of 1 to 13 channels and 8 or 16 bits read as they are
(PIL's conversions where the channel counts differ), a 16-bit PNG not clipped, the transforms in 0..1 by the file's
depth, each channel's statistics from ``sslkit data stats`` into the normalisation, and a 4-channel 16-bit folder
trained on, augmented by the workers and on the device."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
import torch
from helpers import SMALL, four_channel_folder, pixels, run_main
from PIL import Image

from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.data.sources import FolderDataset, UnreadableSampleError, dataset_labels, read_array_image
from sslkit.data.transforms import SimCLRTransform, unit_float
from sslkit.tools.data import data_main

QUIET = ["eval.knn.enabled=false", "log.tensorboard=false"]
#: SMALL on a folder of the test's files: the small CNN, 32 px crops.
FOLDER = ["data=folder", *(o for o in SMALL if not o.startswith(("data=", "data.train.kwargs."))),
          "model.trunk=small_cnn", "data.image_size=32", "data.patch_size=8"]


def test_arrays_of_any_channels_and_depth_read_channels_first(tmp_path: Path) -> None:
    last = pixels((6, 5, 4), np.uint16, 0)
    np.save(tmp_path / "last.npy", last)
    np.save(tmp_path / "first.npy", np.moveaxis(last, -1, 0))
    tifffile.imwrite(tmp_path / "planar.tif", pixels((13, 6, 5), np.uint16, 1), photometric="minisblack")
    for name in ("last.npy", "first.npy"):
        got = read_array_image(str(tmp_path / name), 4)
        assert got.dtype == torch.uint16 and got.shape == (4, 6, 5)
        assert np.array_equal(got.numpy(), np.moveaxis(last, -1, 0))
    planar = read_array_image(str(tmp_path / "planar.tif"), 13)
    assert planar.shape == (13, 6, 5) and np.array_equal(planar.numpy(), tifffile.imread(tmp_path / "planar.tif"))
    # PIL's conversions where the counts differ: grey for RGB repeated, RGB for grey its ITU-R 601-2 luma
    rgb = pixels((6, 5, 3), np.uint8, 2)
    np.save(tmp_path / "rgb.npy", rgb)
    pil_luma = np.asarray(Image.fromarray(rgb).convert("L"))
    assert np.array_equal(read_array_image(str(tmp_path / "rgb.npy"), 1)[0].numpy(), pil_luma)  # its fixed point
    np.save(tmp_path / "unit.npy", rgb.astype(np.float32) / 255)  # float pixels: the luma itself, not rounded to 0/1
    want = (rgb.astype(np.float64) / 255) @ np.array([0.299, 0.587, 0.114])
    assert np.allclose(read_array_image(str(tmp_path / "unit.npy"), 1)[0].numpy(), want, atol=1e-6)
    np.save(tmp_path / "grey.npy", rgb[..., 0])
    assert np.array_equal(read_array_image(str(tmp_path / "grey.npy"), 3).numpy(), np.repeat(rgb[None, ..., 0], 3, 0))
    with pytest.raises(UnreadableSampleError, match=r"13 channels, and the data has 4"):
        read_array_image(str(tmp_path / "planar.tif"), 4)
    np.save(tmp_path / "signed.npy", np.zeros((4, 4), dtype=np.int16))
    with pytest.raises(UnreadableSampleError, match=r"pixels of type int16; sslkit reads 8- and 16-bit unsigned"):
        read_array_image(str(tmp_path / "signed.npy"), 1)


def test_shards_and_hugging_face_datasets_of_npy_and_tiff_members_read_as_the_files(tmp_path: Path) -> None:
    """``sslkit data pack`` copies the files' bytes into tar shards; the shards, a Hugging Face dataset of the same
    bytes, and ones of the pixels as Array3D cells (channels first or last) give each image as the folder does, 16 bits
    and 4 channels kept."""
    datasets = pytest.importorskip("datasets")
    from sslkit.data.hf import HFDataset
    from sslkit.data.shards import ShardDataset

    data = tmp_path / "data"
    four_channel_folder(data)
    tifffile.imwrite(data / "class0" / "t.tif", pixels((4, 32, 32), np.uint16, 99), photometric="minisblack")
    folder = FolderDataset(data, channels=4)
    assert data_main(["pack", f"input={data}", f"output={tmp_path / 'shards'}"]) == 0
    shards = ShardDataset(str(tmp_path / "shards"), channels=4)
    files = [Path(f) for f, _ in folder.samples]
    table = datasets.Dataset.from_dict({"image": [f.read_bytes() for f in files],
                                        "label": [y for _, y in folder.samples]})
    table.save_to_disk(str(tmp_path / "hf"))
    hf = HFDataset(tmp_path / "hf", label_column="label", channels=4)
    assert len(shards) == len(hf) == len(folder) == 25
    with pytest.MonkeyPatch.context() as m:  # the labels come from the Arrow column, not from decoding every row
        m.setattr(HFDataset, "__getitem__", lambda *_: pytest.fail("decoded a row to read its label"))
        assert dataset_labels(hf).tolist() == [y for _, y in folder.samples]
    arrays = [folder[i][0].numpy() for i in range(len(folder))]  # the pixels themselves, [C, H, W] and [H, W, C]
    features = datasets.Features({"image": datasets.Array3D((4, 32, 32), "uint16"), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": arrays, "label": [y for _, y in folder.samples]},
                               features=features).save_to_disk(str(tmp_path / "hf_chw"))
    features = datasets.Features({"image": datasets.Array3D((32, 32, 4), "uint16"), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": [a.transpose(1, 2, 0) for a in arrays],
                                "label": [y for _, y in folder.samples]},
                               features=features).save_to_disk(str(tmp_path / "hf_hwc"))
    cells = [HFDataset(tmp_path / name, label_column="label", channels=4) for name in ("hf_chw", "hf_hwc")]
    # channels: auto, every source's default: the four bands counted from the first readable image of each
    assert [ds.channels for ds in (FolderDataset(data), ShardDataset(str(tmp_path / "shards")),
                                   HFDataset(tmp_path / "hf", label_column="label"),
                                   *(HFDataset(tmp_path / name, label_column="label") for name in ("hf_chw", "hf_hwc")))
            ] == [4, 4, 4, 4, 4]
    for i in (0, 7, 12, 24):
        image, label = folder[i]
        assert image.dtype == torch.uint16 and image.shape == (4, 32, 32)
        for other in (shards, hf, *cells):
            got, got_label = other[i]
            assert torch.equal(got, image) and got_label == label


def test_a_16_bit_png_keeps_its_depth_and_the_transforms_divide_by_65535(tmp_path: Path) -> None:
    """PIL's ``convert("L")`` clips a 16-bit grey PNG at 255; the folder reads its 16 bits."""
    (tmp_path / "a").mkdir()
    deep = pixels((8, 8), np.uint16, 3)
    Image.fromarray(deep).save(tmp_path / "a" / "deep.png")
    image, _ = FolderDataset(tmp_path, channels=1)[0]
    assert image.dtype == torch.uint16 and np.array_equal(image[0].numpy(), deep)
    torch.testing.assert_close(unit_float(image), torch.from_numpy(deep.astype(np.float32))[None] / 65535.0)
    views = SimCLRTransform(8, num_views=2, mean=[0.5], std=[0.25])(image)
    assert all(v.shape == (1, 8, 8) and v.dtype == torch.float32 and torch.isfinite(v).all() for v in views)


def test_data_stats_are_each_channels_mean_and_std_and_normalise_the_run(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    four_channel_folder(data)
    out = tmp_path / "stats.json"
    assert data_main(["stats", f"path={data}", "channels=4", "sample=0", f"output={out}"]) == 0
    found = json.loads(out.read_text())
    every = np.stack([np.load(f) for f in sorted(data.rglob("*.npy"))]).astype(np.float64) / 65535.0
    np.testing.assert_allclose(found["mean"], every.mean(axis=(0, 1, 2)), atol=1e-6)
    np.testing.assert_allclose(found["std"], every.std(axis=(0, 1, 2)), atol=1e-6)
    assert found["channels"] == 4 and found["images"] == 24 and found["dtype"] == ["uint16"]
    assert f"data.stats={out}" in capsys.readouterr().out
    base = ["config=simclr", *FOLDER, f"data.train.path={data}", f"data.test.path={data}",
            "data.train.kwargs.channels=4", "data.test.kwargs.channels=4"]
    cfg = compose_config([*base, f"data.stats={out}"])
    assert list(cfg.data.transform.mean) == found["mean"] and list(cfg.data.eval_transform.std) == found["std"]
    rgb = tmp_path / "rgb.json"
    rgb.write_text(json.dumps({"mean": [0.4, 0.4, 0.4], "std": [0.2, 0.2, 0.2]}))
    with pytest.raises(ConfigError, match=re.escape(f"has 3 values (from data.stats={rgb}: statistics of other "
                                                    "images) but the images of the train split")):
        compose_config([*base, f"data.stats={rgb}"])
    with pytest.raises(ConfigError, match=re.escape(f"'data.stats' = {tmp_path / 'none.json'}: no such file")):
        compose_config([*base, f"data.stats={tmp_path / 'none.json'}"])


@pytest.mark.parametrize(("augment_on", "per_channel"), [("workers", False), ("device", True)])
def test_a_four_channel_16_bit_folder_trains_with_a_four_channel_trunk(tmp_path: Path, augment_on: str,
                                                                       per_channel: bool) -> None:
    """On the device, with brightness and contrast factors per channel (``data.transform.jitter_per_channel``); on
    the workers without the channels said (``auto``: the four counted from the files, as a new user runs it)."""
    data = tmp_path / "data"
    four_channel_folder(data)
    out = tmp_path / "run"
    said = ["data.train.kwargs.channels=4", "data.test.kwargs.channels=4"] if augment_on == "device" else []
    run_main("config=simclr", *FOLDER, *QUIET, f"data.train.path={data}", f"data.test.path={data}",
             *said, "data.batch_size=8", "optim.max_steps=3",
             f"data.augment_on={augment_on}", f"data.transform.jitter_per_channel={per_channel}", f"output_dir={out}")
    state = torch.load(out / "checkpoints" / "checkpoint_000000003.pt", weights_only=True)
    first = next(v for k, v in state["model"].items() if k.endswith("weight") and v.dim() == 4)
    assert first.shape[1] == 4  # the trunk reads the four channels
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


def test_bench_on_16_bit_four_channel_images_leaves_the_8_bit_corruptions_out(tmp_path: Path) -> None:
    """ImageNet-C's corruptions take 8-bit images of 1 or 3 channels: named, the bench stops before extracting and
    says so; by default it measures the other protocols without robustness."""
    from helpers import run_sslkit

    data = tmp_path / "data"
    four_channel_folder(data)
    common = ["backbones=[pixels]", "data=folder", f"data.train.path={data}", f"data.test.path={data}",
              "data.train.kwargs.channels=4", "data.test.kwargs.channels=4", "data.image_size=32", "machine.device=cpu",
              f"bench.cache_dir={tmp_path / 'cache'}", "bench.knn.ks=[5]"]
    code, _, err = run_sslkit("bench", *common, "protocols=[knn,robustness]", f"output={tmp_path / 'named'}")
    assert code == 2 and "the test images are uint16 images of 4 channel(s)" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()
    small = ["bench.linear.epochs=2", "bench.fewshot.shots=[1]", "bench.fewshot.draws=2", "bench.fewshot.cs=[1.0]",
             "bench.fewshot.val_fraction=0.2", "bench.attentive.epochs=2", "bench.attentive.batch_size=8"]
    code, _, err = run_sslkit("bench", *common, *small, f"output={tmp_path / 'default'}")
    assert code == 0, err[-2000:]
    found = json.loads((tmp_path / "default" / "results.json").read_text())
    assert "robustness" not in found["protocols"] and "knn" in found["protocols"]
    assert 0.5 < found["results"]["pixels"]["metrics"]["knn_k5"]["value"] <= 1.0  # the classes differ in channel 4


def test_per_channel_jitter_gives_each_channel_its_own_brightness_and_contrast() -> None:
    """``jitter_per_channel``: after the view's 54 uniforms, C brightness then C contrast uniforms; each factor
    ``lo + u * (hi - lo)`` over [1 - 0.8 s, 1 + 0.8 s]; brightness ``f_c x_c``, contrast ``f_c x_c + (1 - f_c)
    mean(x_c)``, each clamped to [0, 1], in the order the view's uniforms 44-47 sort; saturation and hue skipped (4
    channels). The crop is the whole image, no flip, the jitter always on: the view is this, normalised."""
    channels, s = 4, 0.5
    image = torch.randint(0, 65536, (channels, 12, 12), generator=torch.Generator().manual_seed(5)).to(torch.uint16)
    transform = SimCLRTransform(12, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip_p=0.0, jitter_strength=s,
                                jitter_p=1.0, grayscale_p=0.0, jitter_per_channel=True)
    torch.manual_seed(11)
    u = torch.rand(54 + 2 * channels, dtype=torch.float64).tolist()
    torch.manual_seed(11)
    view = transform.view(image)
    x = image.double() / 65535
    lo, hi = 1 - 0.8 * s, 1 + 0.8 * s
    bright = [lo + u[54 + c] * (hi - lo) for c in range(channels)]
    contrast = [lo + u[54 + channels + c] * (hi - lo) for c in range(channels)]
    for op in sorted(range(4), key=lambda i: u[44 + i]):
        for c in range(channels):
            if op == 0:
                x[c] = (x[c] * bright[c]).clamp(0, 1)
            elif op == 1:
                x[c] = (x[c] * contrast[c] + (1 - contrast[c]) * x[c].mean()).clamp(0, 1)
    torch.testing.assert_close(view.double(), (x - 0.5) / 0.5, rtol=0, atol=1e-5)
    assert len({round(f, 6) for f in bright}) == channels  # four factors, not one
    one = SimCLRTransform(12, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip_p=0.0, jitter_strength=s,
                          jitter_p=1.0, grayscale_p=0.0)
    assert one.uniforms(channels) == 54  # off: the draws of every existing recipe, unchanged


def test_an_image_of_another_channel_count_is_converted_with_a_warning_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 4-band image read for an RGB run loses its fourth band, and a grey one read for RGB is repeated: each is
    said once per process, naming the file, both counts and the key (a 4-band TIFF once trained as RGB in
    silence); an image of the run's own count is not."""
    import logging

    from sslkit.data import notices

    notices.forget()
    Image.new("RGBA", (6, 5), (10, 20, 30, 40)).save(tmp_path / "four.png")
    Image.new("RGBA", (6, 5), (10, 20, 30, 40)).save(tmp_path / "four_again.png")
    Image.new("L", (6, 5), 7).save(tmp_path / "grey.png")
    Image.new("RGB", (6, 5), (1, 2, 3)).save(tmp_path / "rgb.png")
    ds = FolderDataset(tmp_path, channels=3, probe=0)
    with caplog.at_level(logging.WARNING, logger="sslkit"):
        images = {Path(ds.samples[i][0]).name: ds[i][0] for i in range(len(ds))}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # four.png (4 -> 3) and grey.png (1 -> 3): once each, not four_again.png
    assert any("four.png has 4 channel(s) and the run reads 3: its fourth band dropped" in m and
               "data.<split>.kwargs.channels=4" in m for m in said), said
    assert any("grey.png has 1 channel(s) and the run reads 3: its grey repeated" in m for m in said), said
    assert images["four.png"][:, 0, 0].tolist() == [10, 20, 30] and images["grey.png"][:, 0, 0].tolist() == [7, 7, 7]
    notices.forget()


def _one(folder: Path, name: str, write: Any) -> FolderDataset:
    """A folder of one class holding the file ``name`` that ``write(path)`` writes, read with ``channels: auto``."""
    (folder / "a").mkdir(parents=True)
    write(folder / "a" / name)
    return FolderDataset(folder)


def test_channels_auto_counts_the_bands_each_format_holds(tmp_path: Path) -> None:
    """``auto`` (every file source's default) counts what the file holds: a TIFF's every band (a fourth band is a
    measurement as often as alpha), a PNG's bands without its alpha, a palette as RGB, an array's shorter end; then
    reads every image with that count."""
    def png(mode: str, size: tuple[int, int] = (6, 5)) -> Any:
        return lambda p: Image.new(mode, size).save(p)

    cases = {
        "tiff16x4": ("x.tif", lambda p: tifffile.imwrite(p, pixels((6, 5, 4), np.uint16, 0)), 4),
        "tiff8x3": ("x.tif", lambda p: tifffile.imwrite(p, pixels((6, 5, 3), np.uint8, 1)), 3),
        "rgba": ("x.png", png("RGBA"), 3), "grey_alpha": ("x.png", png("LA"), 1), "grey": ("x.png", png("L"), 1),
        "grey16": ("x.png", lambda p: Image.fromarray(pixels((6, 5), np.uint16, 2)).save(p), 1),
        "palette": ("x.png", png("P"), 3), "rgb_jpeg": ("x.jpg", png("RGB", (16, 16)), 3),
        "npy_first": ("x.npy", lambda p: np.save(p, pixels((13, 32, 30), np.uint8, 3)), 13),
        "npy_last": ("x.npy", lambda p: np.save(p, pixels((32, 30, 2), np.uint16, 4)), 2),
    }
    for name, (file, write, want) in cases.items():
        ds = _one(tmp_path / name, file, write)
        image, _ = ds[0]
        assert (ds.channels, image.shape[0]) == (want, want), name
    both = _one(tmp_path / "rgba_read", "x.png", lambda p: Image.new("RGBA", (6, 5), (1, 2, 3, 4)).save(p))
    assert both[0][0][:, 0, 0].tolist() == [1, 2, 3]  # its RGB, the alpha dropped (and said)
    assert FolderDataset(tmp_path / "tiff16x4", channels=3).channels == 3  # a count given is taken as it is


def test_channels_auto_skips_unreadable_files_and_names_the_folder_when_none_can_be_counted(tmp_path: Path) -> None:
    from sslkit.data.sources import DataSourceError

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "0_bad.png").write_bytes(b"\x89PNG not really")
    np.save(tmp_path / "a" / "1_good.npy", pixels((6, 5, 4), np.uint8, 0))
    assert FolderDataset(tmp_path).channels == 4  # the first readable one, not the first
    (tmp_path / "a" / "1_good.npy").write_bytes(b"\x93NUMPY cut")
    with pytest.raises(DataSourceError, match=r"no readable image in .*: all 2 image files are corrupt"):
        FolderDataset(tmp_path)
    with pytest.raises(DataSourceError, match=r"channels must be 1 or more, or auto .*got 'four'"):
        FolderDataset(tmp_path, channels="four")


def test_data_stats_give_the_count_before_any_image_is_read(tmp_path: Path) -> None:
    """With ``data.stats`` the composed config says the channels (the file's count) where the split would count them
    (``auto``); a split given a count keeps it (validation names a mismatch)."""
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"mean": [0.1, 0.2, 0.3, 0.4], "std": [0.5] * 4}))
    four_channel_folder(tmp_path / "data")
    cfg = compose_config(["config=simclr", "data=folder", f"data.train.path={tmp_path / 'data'}",
                          f"data.stats={stats}"])
    assert cfg.data.train.kwargs.channels == 4 and cfg.data.test.kwargs.channels == 4
    with pytest.raises(ConfigError, match=r"'data.transform.mean' has 4 values .* train split \(source folder\) have "
                                          r"1 channel"):
        compose_config(["config=simclr", "data=folder", f"data.train.path={tmp_path / 'data'}", f"data.stats={stats}",
                        "data.train.kwargs.channels=1"])


def test_a_run_says_a_conversion_once_over_its_workers_and_its_report_repeats_it(tmp_path: Path) -> None:
    """Training on RGB images (counted: ``auto``, from the first) with grey ones among them that only the two loader
    workers read (the main process reads the first image alone): the conversion of grey to RGB is said once in the
    run's log, with the file and both counts, and again in report.md."""
    from sslkit.data import notices

    notices.forget()
    data = tmp_path / "data"
    for c in range(2):
        (data / f"class{c}").mkdir(parents=True)
        for i in range(12):
            px = pixels((32, 32, 3), np.uint8, 10 * c + i)
            rgb = i % 4 != 3  # 0.png, the first in order, is RGB: the count is read from it
            Image.fromarray(px if rgb else px[..., 0], "RGB" if rgb else "L").save(data / f"class{c}" / f"{i}.png")
    out = tmp_path / "run"
    run_main("config=simclr", *FOLDER, "log.tensorboard=false", "log.report=true", f"data.train.path={data}",
             f"data.test.path={data}", "data.batch_size=8", "optim.max_steps=6", "data.num_workers=2",
             "eval.knn.k=3", f"output_dir={out}")
    state = torch.load(out / "checkpoints" / "checkpoint_000000006.pt", weights_only=True)
    first = next(v for k, v in state["model"].items() if k.endswith("weight") and v.dim() == 4)
    assert first.shape[1] == 3
    log = (out / "log.txt").read_text()
    said = [line for line in log.splitlines() if "has 1 channel(s) and the run reads 3: its grey repeated" in line]
    assert len(said) == 2 and "- data warning: " in said[1], said  # once as it happened, once in the logged report
    assert "3 channel(s), read from its image 0 (channels: auto)" in log
    report = (out / "report.md").read_text()
    assert re.search(r"- data warning: \S+\.png has 1 channel\(s\) and the run reads 3: its grey repeated", report)
    assert len(list((out / "notices").glob("*.txt"))) == 1


def _say(folder: str, key: str) -> None:
    """A process's :func:`~sslkit.data.notices.say_once` within a run's folder; its exit code says whether it spoke."""
    from sslkit.data import notices

    with notices.kept_in(folder):
        os._exit(0 if notices.say_once(key, f"notice {key}") else 3)


def test_a_notice_is_said_by_one_process_of_a_run_and_by_every_process_outside_one(tmp_path: Path) -> None:
    import multiprocessing

    from sslkit.data import notices

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_say, args=(str(tmp_path), key)) for key in ("a", "a", "a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    codes = [p.exitcode for p in procs]
    assert sorted(codes[:3]) == [0, 3, 3] and codes[3] == 0, codes  # one of three said "a"; "b" said too
    assert notices.read_notices(tmp_path) == ["notice a", "notice b"]
    notices.forget()
    assert notices.say_once("c", "outside a run") and not notices.say_once("c", "outside a run")  # once a process
    notices.forget()


def test_an_evaluation_set_left_to_count_reads_the_training_images_count(tmp_path: Path) -> None:
    """A grey test split of an RGB run is read as RGB, as the trunk takes it (its own count, 1, would stop the kNN);
    the training split counts its own."""
    from sslkit.builder import eval_sources

    for root, mode in ((tmp_path / "rgb", "RGB"), (tmp_path / "grey", "L")):
        for c in range(2):
            (root / f"class{c}").mkdir(parents=True)
            Image.new(mode, (8, 8), 40 * c).save(root / f"class{c}" / "0.png")
    cfg = compose_config(["config=simclr", *FOLDER, f"data.train.path={tmp_path / 'rgb'}",
                          f"data.test.path={tmp_path / 'grey'}"])
    train, test, _ = eval_sources(cfg)
    assert (train.channels, test.channels, test[0][0].shape[0]) == (3, 3, 3)


def test_a_jpeg_handed_to_the_device_decoder_says_its_count_too(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """``data.decode_on=device`` gives JPEG bytes undecoded; the frame header's component count (read from the
    markers, as PIL's decode finds it) is still said where it is not the run's, and the bytes stay the file's."""
    import io
    import logging

    from sslkit.data import notices
    from sslkit.data.channels import jpeg_channels

    def jpeg(mode: str, **kw: Any) -> bytes:
        out = io.BytesIO()
        Image.new(mode, (16, 12), 90).save(out, "JPEG", **kw)
        return out.getvalue()

    for mode, kw in (("L", {}), ("RGB", {}), ("RGB", {"progressive": True}), ("CMYK", {}),
                     ("RGB", {"optimize": True, "quality": 50})):
        data = jpeg(mode, **kw)
        assert jpeg_channels(data) == len(Image.open(io.BytesIO(data)).getbands()), (mode, kw)
    assert jpeg_channels(jpeg("RGB")[:12]) is None and jpeg_channels(b"\x89PNG\r\n\x1a\n") is None
    notices.forget()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "grey.jpg").write_bytes(jpeg("L"))
    (tmp_path / "a" / "rgb.jpg").write_bytes(jpeg("RGB"))
    ds = FolderDataset(tmp_path, channels=3, probe=0)
    ds.jpeg_bytes = True
    with caplog.at_level(logging.WARNING, logger="sslkit"):
        got = [ds[i][0] for i in range(len(ds))]
    assert [bytes(g.numpy()) for g in got] == [(tmp_path / "a" / n).read_bytes() for n in ("grey.jpg", "rgb.jpg")]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "grey.jpg has 1 channel(s) and the run reads 3: its grey repeated" in said[0], said
    notices.forget()


def test_a_tool_reads_sets_left_to_count_with_the_trained_trunks_channels(tmp_path: Path) -> None:
    """``sslkit knn`` on a run of RGB images whose labelled sets (``eval.data.*``) are grey folders left to count:
    they are read as RGB, the trunk's count taken from the checkpoint, not from the training folder (grey since)."""
    from helpers import run_sslkit

    data = tmp_path / "train"
    (data / "all").mkdir(parents=True)
    for i in range(16):
        Image.fromarray(pixels((32, 32, 3), np.uint8, i)).save(data / "all" / f"{i}.png")
    for split in ("a", "b"):
        for c in range(2):
            (tmp_path / split / f"class{c}").mkdir(parents=True)
            for i in range(4):
                Image.fromarray(pixels((32, 32), np.uint8, 50 + 10 * c + i) // (1 + c)).save(
                    tmp_path / split / f"class{c}" / f"{i}.png")
    out = tmp_path / "run"
    labelled = [f"eval.data.train.path={tmp_path / 'a'}", f"eval.data.test.path={tmp_path / 'b'}",
                "eval.data.train.source=folder"]
    run_main("config=simclr", *FOLDER, *QUIET, f"data.train.path={data}", *labelled, "data.batch_size=8",
             "optim.max_steps=2", f"output_dir={out}")
    for i in range(16):  # the training folder's images replaced by grey ones: counted now, it would say 1
        Image.fromarray(pixels((32, 32), np.uint8, i)).save(data / "all" / f"{i}.png")
    code, _, stderr = run_sslkit("knn", f"checkpoint={out}", "eval.knn.k=3")
    assert code == 0, stderr[-2000:]
    found = json.loads((out / "eval" / "knn.json").read_text())
    assert 0.0 <= found["top1"] <= 1.0
