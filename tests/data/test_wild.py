"""The proving ground, Fashion-MNIST in the wild: the renderer against hand-made cases (a garment drawn back pixel for
pixel, MNIST-M's difference, boxes against class maps), images as a pure function of (seed, split, index) in any
batch, process or worker count, the stored digests of version 1, the photographs' split and licence, the folder and
shards written and read back, the cache built once, and every bad option refused with nothing written."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import HANG_S

from sslkit.data.photos import (
    DEAD_LEAVES,
    DEFAULT_PHOTOS,
    Photo,
    PhotoError,
    dead_leaves,
    load_photos,
    split_photos,
)
from sslkit.data.segmentation import IGNORE_INDEX, SegmentationFolder
from sslkit.data.sources import DEBIAN_FASHION_MNIST
from sslkit.data.wild import WILD_VERSION, WildScenes, WildSpec, WildSpecError

needs_fashion = pytest.mark.skipif(not Path(DEBIAN_FASHION_MNIST).is_dir(),
                                   reason="no Fashion-MNIST here (apt-get install dataset-fashion-mnist)")


def _garments(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random garments, four of each class."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8), torch.arange(n) % 10


def _flat_photo(name: str, value: int, side: int = 64) -> Photo:
    return Photo(name, (np.full((side, side, 3), value, dtype=np.uint8),), None)


def _exact(blend: str, photo_value: int) -> WildScenes:
    """A canvas of a garment's own size, no turn, no scaling, a white tint, no distractors: the garment lands on the
    pixel grid exactly."""
    images, labels = _garments()
    spec = WildSpec(canvas=28, scale=(1.0, 1.0), rotation=0.0, saturation=(0.0, 0.0), value=(1.0, 1.0),
                    distractors=(0, 0), zooms=(1,), blend=blend)
    return WildScenes(images, labels, [_flat_photo("p", photo_value, 28)], spec, 0, "train", 10)


def test_a_garment_on_its_own_grid_is_drawn_back_pixel_for_pixel() -> None:
    images, labels = _garments()
    over = _exact("over", 0).render(np.arange(10))
    for i in range(10):
        assert np.array_equal(over.images[i], images[i, 0].numpy()[:, :, None].repeat(3, 2)), i
        assert over.labels[i] == labels[i]
    # MNIST-M's blend: |photo - garment| per channel
    diff = _exact("difference", 200).render(np.arange(10))
    expected = np.abs(200 - images[:10, 0].numpy().astype(np.int64))[..., None].repeat(3, -1)
    assert np.array_equal(diff.images.astype(np.int64), expected)
    # its class map: garment pixels above 0.1 of full intensity take class + 1, fainter lit ones are ignored
    g = images[3, 0].numpy().astype(np.float64) / 255
    want = np.where(g > 0.1, int(labels[3]) + 1, np.where(g > 0, IGNORE_INDEX, 0))
    assert np.array_equal(diff.masks[3], want)


def test_boxes_and_areas_are_those_of_each_garments_pixels_in_the_class_map() -> None:
    images, labels = _garments(60, seed=1)
    photos = [_flat_photo("a", 90), _flat_photo("b", 30)]
    spec = WildSpec(distractors=(2, 2))
    out = WildScenes(images, labels, photos, spec, 3, "train", 50).render(np.arange(50))
    distractors = 0
    for i in range(50):
        main = [o for o in out.objects[i] if o.main]
        assert len(main) == 1 and main[0].category == out.labels[i] == labels[i % 60]
        for o in out.objects[i]:
            x, y, w, h = o.box
            assert 0 <= x and 0 <= y and x + w <= 32 and y + h <= 32 and 0 < o.area <= w * h
            inside = out.masks[i][y:y + h, x:x + w] == o.category + 1
            assert inside.sum() >= o.area and inside[0].any() and inside[-1].any() and inside[:, 0].any()
            distractors += not o.main
        assert all(o.category != out.labels[i] for o in out.objects[i] if not o.main)  # other classes
        classes = {o.category for o in out.objects[i]}
        pixels = out.masks[i][(out.masks[i] != 0) & (out.masks[i] != IGNORE_INDEX)]
        assert set((pixels - 1).tolist()) <= classes
    assert distractors > 40  # two drawn each; a few may be hidden or off the canvas


def test_an_image_is_a_function_of_seed_split_and_index_alone() -> None:
    images, labels = _garments()
    photos = [_flat_photo("a", 90), _flat_photo("b", 30), _flat_photo("c", 150)]
    scenes = WildScenes(images, labels, photos, WildSpec(), 5, "train", 300)
    whole = scenes.render(np.arange(300))
    for picked in ([299, 0, 17], [17], [120, 121, 5, 5]):  # any batch, any order, repeated
        again = scenes.render(np.array(picked))
        assert np.array_equal(again.images, whole.images[picked])
        assert np.array_equal(again.masks, whole.masks[picked])
    image, label = scenes[17]
    assert torch.equal(image, torch.from_numpy(whole.images[17]).permute(2, 0, 1)) and label == int(whole.labels[17])
    assert torch.equal(scenes.labels, torch.from_numpy(whole.labels))
    other_seed = WildScenes(images, labels, photos, WildSpec(), 6, "train", 300).render(np.arange(20))
    other_split = WildScenes(images, labels, photos, WildSpec(), 5, "test", 300).render(np.arange(20))
    assert not np.array_equal(other_seed.images, whole.images[:20])
    assert not np.array_equal(other_split.images, whole.images[:20])


def test_photographs_split_disjoint_every_third_to_test_and_dead_leaves_are_fixed() -> None:
    names = [f"p{k:02d}.jpg" for k in range(12)]
    train, test = split_photos(names[::-1])  # the order given does not matter: by name
    assert sorted(names[::-1][k] for k in test) == ["p02.jpg", "p05.jpg", "p08.jpg", "p11.jpg"]
    assert not set(train) & set(test) and len(train) + len(test) == 12
    assert split_photos(["a", "b"]) == ([0], [1])
    with pytest.raises(PhotoError, match="at least 2"):
        split_photos(["a"])
    a, b = dead_leaves(3, side=96), dead_leaves(3, side=96)
    assert np.array_equal(a, b) and not np.array_equal(a, dead_leaves(4, side=96))
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 20  # many leaves, many colours
    photos = load_photos(DEAD_LEAVES, 32, (2, 4))
    assert [p.name for p in photos.test] == ["dead_leaves_02", "dead_leaves_05", "dead_leaves_08", "dead_leaves_11"]
    assert [lv.shape[:2] for lv in photos.train[0].levels] == [(64, 64), (128, 128)]
    assert "no licence needed" in photos.describe()["licence"]


def test_photograph_folders_that_cannot_serve_are_refused(tmp_path: Path) -> None:
    from PIL import Image

    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "a.jpg").write_bytes(b"not an image")
    with pytest.raises(PhotoError, match="no readable image among its 1"):
        load_photos(str(tmp_path / "none"), 32, (2,))
    (tmp_path / "one").mkdir()
    Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(tmp_path / "one" / "x.png")
    with pytest.raises(PhotoError, match="at least 2"):
        load_photos(str(tmp_path / "one"), 32, (2,))
    with pytest.raises(PhotoError, match="does not exist"):
        load_photos(str(tmp_path / "missing"), 32, (2,))
    Image.fromarray(np.full((50, 80, 3), 7, np.uint8)).save(tmp_path / "one" / "y.png")
    photos = load_photos(str(tmp_path / "one"), 32, (2,), licence="CC0")
    assert photos.licence == "CC0" and photos.train[0].levels[0].shape == (64, 96, 3)  # shorter side 2 x 32


def test_knobs_out_of_range_name_themselves() -> None:
    for knobs, match in (({"canvas": 20}, r"canvas=20: smaller than a garment \(28 px x scale 1 = 28 px\)"),
                         ({"scale": (0.0, 1.0)}, "scale="), ({"rotation": 400.0}, "rotation=400"),
                         ({"distractors": (3, 1)}, "distractors="), ({"blend": "add"}, "blend=add"),
                         ({"zooms": ()}, "zooms=")):
        with pytest.raises(WildSpecError, match=match):
            WildSpec(**knobs)  # type: ignore[arg-type]
    assert WildSpec(canvas=17, scale=(0.5, 0.6)).canvas == 17  # a smaller garment fits a smaller canvas


def _digest(scenes: WildScenes) -> str:
    return hashlib.sha256(np.ascontiguousarray(scenes.render(np.arange(len(scenes))).images).tobytes()).hexdigest()


@needs_fashion
def test_version_1_images_are_the_stored_ones() -> None:
    """The digests below were taken once from version 1 (dead leaves: on any machine; the mate photographs: where
    Debian's mate-backgrounds is installed, as CI installs it). A change that fails this test changes the images:
    raise WILD_VERSION and take the digests again."""
    from sslkit.data.sources import build_source

    assert WILD_VERSION == 1
    expected = {(DEAD_LEAVES, "train"): "a5adf7a663116b498b372dff3cd70a1466e8b283cb19ec82e7d3e0506163a983",
                (DEAD_LEAVES, "test"): "092496fbb9b964228533ececa2cea4fae0c85f27a8dceda41ba118b4e346875c",
                (None, "train"): "a617bb5d40ffedb7d3e951de698bf7991817314736333a58e7fedf727b72fe29",
                (None, "test"): "267a4197d6a7eefa5bb37faa8707b6ce27c5f63bcf92902f55574082668e641c"}
    for (photos, split), digest in expected.items():
        if photos is None and not Path(DEFAULT_PHOTOS).is_dir():
            continue
        found = load_photos(photos, 32, WildSpec().zooms)
        src = build_source("fashion_mnist", split)
        scenes = WildScenes(src.images, src.labels, found.split(split), WildSpec(), 0, split, 64)  # type: ignore[attr-defined]
        assert _digest(scenes) == digest, (photos, split)


def _small_set(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    from sslkit.launch.cli import console

    out = tmp_path / "wild"
    return console(["data", "wild", f"output={out}", "train=70", "test=30", f"photos={DEAD_LEAVES}", *extra]), out


@needs_fashion
def test_sslkit_data_wild_writes_images_boxes_class_maps_and_its_metadata(tmp_path: Path) -> None:
    from sslkit.data.wild_files import CLASS_FOLDERS, build_wild, is_wild, wild_pairs

    code, out = _small_set(tmp_path, "seed=4", "workers=2")
    assert code == 0 and is_wild(out)
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["version"] == WILD_VERSION and meta["seed"] == 4 and meta["counts"] == {"train": 70, "test": 30}
    assert meta["photographs"]["origin"] == DEAD_LEAVES and len(meta["photographs"]["test"]) == 4
    assert {p["name"] for p in meta["photographs"]["train"]}.isdisjoint(p["name"] for p in meta["photographs"]["test"])
    train = build_wild("train", str(out))
    assert len(train) == 70 and train.images.shape == (70, 3, 32, 32) and train.num_classes == 10
    # the same pixels as the renderer gives, whatever wrote them (two worker processes here)
    from sslkit.data.sources import build_source

    src = build_source("fashion_mnist", "train")
    scenes = WildScenes(src.images, src.labels, load_photos(DEAD_LEAVES, 32, WildSpec().zooms).train,  # type: ignore[attr-defined]
                        WildSpec(), 4, "train", 70)
    rendered = scenes.render(np.arange(70))
    assert torch.equal(train.images, torch.from_numpy(rendered.images).permute(0, 3, 1, 2))
    assert torch.equal(train.labels, torch.from_numpy(rendered.labels))
    assert meta["pixels_sha256"]["train"] == hashlib.sha256(rendered.images.tobytes()).hexdigest()
    # the ImageFolder tree: each image under its class's folder
    assert sorted(p.name for p in (out / "train").iterdir()) == list(CLASS_FOLDERS)
    # COCO boxes: one labelled garment per image, its category the image's class
    coco = json.loads((out / "annotations" / "instances_train.json").read_text())
    assert len(coco["images"]) == 70 and [c["id"] for c in coco["categories"]] == list(range(1, 11))
    mains = {a["image_id"]: a for a in coco["annotations"] if a["main"]}
    assert len(mains) == 70 and all(mains[i]["category_id"] == int(rendered.labels[i]) + 1 for i in range(70))
    assert all(Path(out / im["file_name"]).is_file() for im in coco["images"])
    # the class maps, read as a segmentation folder reads ADE20K (reduce_zero_label): the renderer's maps
    pairs = wild_pairs(out, "train")
    folder = SegmentationFolder.from_pairs(pairs)
    for i in (0, 69):
        image, mask = folder[i]
        assert torch.equal(image, train.images[i])
        assert torch.equal(mask, torch.from_numpy(rendered.masks[i].astype(np.int64)))  # 255: ignored


@needs_fashion
def test_one_and_two_workers_and_shards_give_the_same_images(tmp_path: Path) -> None:
    from sslkit.data.wild_files import build_wild

    code, one = _small_set(tmp_path / "a")
    code2, two = _small_set(tmp_path / "b", "workers=2", "format=shards")
    assert code == code2 == 0
    a, b = (json.loads((p / "dataset.json").read_text())["pixels_sha256"] for p in (one, two))
    assert a == b
    assert sorted(p.name for p in (two / "train").iterdir())[0] == "shard-000000.tar"
    import tarfile

    with tarfile.open(two / "train" / "shard-000000.tar") as tar:
        members = set(tar.getnames())
    coco = json.loads((two / "annotations" / "instances_train.json").read_text())
    assert all(im["file_name"] in members for im in coco["images"])  # each image entry names its member
    got, want = build_wild("test", str(two)), build_wild("test", str(one))
    assert torch.equal(got.images, want.images) and torch.equal(got.labels, want.labels)


@needs_fashion
@pytest.mark.parametrize("args, match", [
    (["photos=NONE"], "no readable image"),
    (["photos=ONE"], "at least 2"),
    (["canvas=20"], "canvas=20: smaller than a garment"),
    (["seed=abc"], "seed=abc: give a whole number"),
    (["train=ten"], "train=ten: give a whole number"),
    (["train=0"], "train=0: give a number of images"),
    (["scale=[0.5]"], r"scale=\[0.5\]: give \[low,high\]"),
    (["format=zip"], "format=zip: give folder"),
])
def test_bad_options_exit_2_with_a_message_and_write_nothing(tmp_path: Path, args: list[str], match: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    from sslkit.launch.cli import console

    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "a.jpg").write_bytes(b"\xff\xd8 truncated")
    (tmp_path / "one").mkdir()
    Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(tmp_path / "one" / "x.png")
    args = [a.replace("NONE", str(tmp_path / "none")).replace("ONE", str(tmp_path / "one")) for a in args]
    out = tmp_path / "out"
    assert console(["data", "wild", f"output={out}", "train=10", "test=5", *args]) == 2
    err = capsys.readouterr().err
    assert "sslkit data: error:" in err and "Traceback" not in err
    import re

    assert re.search(match, err), err
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@needs_fashion
def test_an_existing_folder_with_files_is_never_written_over(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from sslkit.launch.cli import console

    out = tmp_path / "wild"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert console(["data", "wild", f"output={out}", "train=10", "test=5"]) == 2
    assert "give a new or empty folder" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"


def _build(cache: str, queue: multiprocessing.Queue) -> None:
    import os

    os.environ["SSLKIT_CACHE_DIR"] = cache  # a forked process of its own
    from sslkit.data.wild_files import build_wild

    ds = build_wild("train", None, train=40, test=10, photos=DEAD_LEAVES)
    queue.put(hashlib.sha256(ds.images.numpy().tobytes()).hexdigest())


@needs_fashion
def test_data_wild_without_a_folder_builds_the_cache_once_for_every_process(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes asking at once: one builds under the lock, the other waits and reads the same set."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=HANG_S)
    assert [p.exitcode for p in procs] == [0, 0]
    assert queue.get(timeout=HANG_S) == queue.get(timeout=HANG_S)
    built = [p for p in (tmp_path / "wild").iterdir() if p.is_dir() and p.name != "arrays"]
    assert len(built) == 1 and not [p for p in (tmp_path / "wild").iterdir() if "partial" in p.name]
    stamp = (built[0] / "dataset.json").stat().st_mtime_ns
    monkeypatch.setenv("SSLKIT_CACHE_DIR", str(tmp_path))
    from sslkit.data.wild_files import build_wild

    again = build_wild("test", None, train=40, test=10, photos=DEAD_LEAVES)  # read, not rebuilt
    assert len(again) == 10 and (built[0] / "dataset.json").stat().st_mtime_ns == stamp
    # each split decoded once, then read from its array named by the pixel digest
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "wild" / "arrays").iterdir()) == ["test.npz", "train.npz"]
    (built[0] / "test" / "0-t-shirt-top").rename(built[0] / "moved")  # the files are not read again
    assert torch.equal(build_wild("test", None, train=40, test=10, photos=DEAD_LEAVES).images, again.images)


@needs_fashion
def test_data_wild_trains_a_recipe_and_its_class_maps_feed_the_dense_probe(tmp_path: Path) -> None:
    """The preset composes (its test split takes the training split's knobs), a run trains on a folder the command
    wrote and measures its kNN there, and eval.dense.dataset=wild (the preset's) reads the same set's class maps."""
    from helpers import run_main

    from sslkit.builder.data import eval_specs
    from sslkit.config.compose import compose_config
    from sslkit.tools.dense import segmentation_sets

    code, out = _small_set(tmp_path)
    assert code == 0
    cfg = compose_config(["data=wild", f"data.train.path={out}", "+data.train.kwargs.seed=4"])
    assert eval_specs(cfg)["test"][2] == {"seed": 4} and cfg.data.image_size == 32
    cfg.data.train.kwargs = {}
    train, test, classes, described = segmentation_sets(cfg)
    assert classes == 11 and described["dataset"] == "wild" and (len(train), len(test)) == (70, 30)
    image, mask = test[0]
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and int(mask.max()) in (*range(11), 255)
    run = tmp_path / "run"
    run_main("config=simclr", "data=wild", f"data.train.path={out}", "machine.device=cpu", "data.batch_size=16",
                    "data.num_workers=0", "model.head.hidden_dim=32", "model.head.out_dim=16",
                    "model.trunk_kwargs={width: 8}", "optim.epochs=1", "eval.knn.k=5", "log.report=false",
                    f"output_dir={run}")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("knn_top1" in line for line in lines)
    # the preset's reference sets: both domains watched from the start to the end
    for name in ("studio", "wild"):
        watched = [line[f"ref_{name}_knn_top1"] for line in lines if f"ref_{name}_knn_top1" in line]
        assert len(watched) >= 2 and all(0.0 <= v <= 1.0 for v in watched), name


@needs_fashion
def test_the_studio_and_the_wild_domains_are_one_trunks_input_and_reference_sets_of_each_other(
        tmp_path: Path) -> None:
    """data=studio is Fashion-MNIST's garments as RGB (the grey repeated) centred on the wild set's 32 px canvas; both
    presets name the same two reference sets, each read with three channels and ten classes, the wild one from the
    run's own folder when the run is on the wild set."""
    from omegaconf import open_dict

    from sslkit.builder.data import reference_sets
    from sslkit.config.compose import compose_config
    from sslkit.data.sources import build_fashion_mnist

    code, out = _small_set(tmp_path)
    assert code == 0
    studio = compose_config(["data=studio"])
    wild = compose_config(["data=wild", f"data.train.path={out}"])
    assert (studio.data.image_size, studio.data.small_image_size) == (wild.data.image_size, wild.data.small_image_size)
    assert studio.eval.reference.sets == wild.eval.reference.sets
    with open_dict(studio):  # the default wild set is 70,000 images: the small one here
        studio.eval.reference.sets[1].path = str(out)
    grey = build_fashion_mnist("test")
    for cfg in (studio, wild):
        found = {name: (memory, queries, classes) for name, memory, queries, classes in reference_sets(cfg)}
        assert sorted(found) == ["studio", "wild"]
        for name, (memory, queries, classes) in found.items():
            assert classes == 10 and len(memory) + len(queries) == (2000 if name == "studio" else 30), name
            image, label = memory[0]
            assert image.shape == (3, 32, 32), name
        image, label = found["studio"][0][0]  # a test garment, its grey in each channel, a 2 px black border around
        same = (grey.images[:, 0] == image[0, 2:30, 2:30]).all(dim=2).all(dim=1)
        assert int(image.sum()) == int(image[:, 2:30, 2:30].sum())
        assert torch.equal(image, image[:1].expand(3, -1, -1)) and label in grey.labels[same].tolist()


@needs_fashion
def test_a_fashion_mnist_vit_recipe_trains_on_data_wild_with_its_patches_scaled(tmp_path: Path) -> None:
    """config=dino_vit data=wild: 8 px patches and 16 px local crops (the recipe's 7 and 14 scaled to 32 px, the same
    token grids), recorded in the run's config, and the run takes its steps."""
    from helpers import run_main
    from omegaconf import OmegaConf

    code, out = _small_set(tmp_path)
    assert code == 0
    run = tmp_path / "run"
    run_main("config=dino_vit", "data=wild", f"data.train.path={out}", "machine.device=cpu", "data.batch_size=8",
             "data.num_workers=0", "model.trunk_kwargs.depth=1", "model.head.hidden_dim=16",
             "model.head.bottleneck_dim=8", "model.head.out_dim=32", "data.transform.num_small=2", "optim.max_steps=2",
             "eval.knn.enabled=false", "log.report=false", f"output_dir={run}")
    cfg = OmegaConf.load(run / "config.yaml")
    assert (cfg.model.trunk_kwargs.patch_size, cfg.data.small_image_size, cfg.data.transform.small_size) == (8, 16, 16)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps and all(np.isfinite(s["loss"]) for s in steps)
