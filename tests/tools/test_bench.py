"""sslkit bench end to end on tiny runs: the results folder, the figures against a direct computation, the feature
cache (reused; a changed weight or image is never served stale), bad input before any extraction, a backbone failing
mid-bench, compare and --dry-run."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL, VIT, photo_folder, run_main, run_sslkit

from sslkit.evaluation.knn import knn_predictions
from sslkit.tools.bench.cache import FeatureCache

TINY = [*SMALL, "optim.max_steps=2", "log.tensorboard=false"]
#: Small synthetic splits and a small grid: every protocol runs in seconds.
QUICK = ["data=synthetic", "data.train.kwargs.num_samples=60", "+data.test.kwargs.num_samples=40",
         "machine.device=cpu", "bench.num_workers=0", "bench.bootstrap=200", "bench.batch_size=32",
         "bench.knn.ks=[5,20]", "bench.linear.epochs=2", "bench.linear.lrs=[0.01,0.1]", "bench.fewshot.draws=2",
         "bench.fewshot.shots=[1,0]", "bench.fewshot.val_fraction=0.2",
         "bench.robustness.corruptions=[contrast,jpeg]", "bench.robustness.severities=[1]",
         "bench.robustness.k=5", "bench.attentive.epochs=2", "bench.attentive.batch_size=16"]
#: A few small Fashion-MNIST scenes for the dense protocol.
SCENES = ["eval.dense.scenes.train=24", "eval.dense.scenes.test=12", "eval.dense.epochs=2", "eval.dense.batch_size=8"]


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "simclr"
    run_main("config=simclr", *TINY, f"output_dir={out}")
    return out


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "vit"
    run_main("config=simclr_vit", *TINY, *VIT, f"output_dir={out}")
    return out


def bench(*args: str) -> tuple[int, str, str]:
    return run_sslkit("bench", *QUICK, *args)


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def _direct_knn(run: Path, k: int) -> float:
    """kNN top-1 of the run's trunk computed here: its own eval transform on the same synthetic splits."""
    from sslkit.data import build_source
    from sslkit.data.transforms import EvalTransform
    from sslkit.tools.pretrained import load_pretrained

    pre = load_pretrained(str(run), ["machine.device=cpu"])
    t = pre.config.data.eval_transform
    tf = EvalTransform(int(t.get("image_size", pre.config.data.image_size)), t.get("resize"), t.get("mean"),
                       t.get("std"), t.get("crop_pct"))
    feats = {}
    for split, n in (("train", 60), ("test", 40)):
        ds = build_source("synthetic", split, None, num_samples=n, image_size=32, channels=3)
        x = torch.stack([tf(ds[i][0])[0] for i in range(len(ds))])
        with torch.no_grad():
            f = pre.trunk.eval()(x)
        feats[split] = (f, torch.tensor([ds[i][1] for i in range(len(ds))]))
    pred = knn_predictions(feats["train"][0], feats["train"][1], feats["test"][0], 10, [k])[k]
    return float((pred == feats["test"][1]).double().mean())


def test_bench_writes_one_table_for_runs_pixels_and_random_init(cnn_run: Path, vit_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    code, stdout, stderr = bench(f"backbones=[{cnn_run}, {vit_run}, pixels, random]", f"output={out}",
                                 f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 0, stderr[-3000:]
    for ext in ("json", "md", "csv", "png"):
        assert (out / f"results.{ext}").stat().st_size > 0
    r = _results(out)
    names = [str(cnn_run), str(vit_run), "pixels", "random (small_cnn)", "random (vit_tiny)"]
    assert r["backbones"] == names
    wanted = {"knn_k5", "knn_k20", "linear", "fewshot_1", "fewshot_all", "map_at_r", "recall_at_1", "recall_at_5",
              "recall_at_10", "robust_knn", "robust_linear"}
    for name in names:
        tokens = "small_cnn" not in name and name != str(cnn_run)  # by default, attentive where there are tokens
        assert set(r["results"][name]["metrics"]) == wanted | ({"attentive"} if tokens else set()), name
        assert 0.0 <= r["results"][name]["metrics"]["linear"]["value"] <= 1.0
    assert r["results"][str(cnn_run)]["details"]["attentive"] == {"not_measured": "small_cnn gives no patch tokens"}
    assert "dense" not in r["protocols"]  # the scenes are Fashion-MNIST's: not beside synthetic data unless asked
    att = r["results"][str(vit_run)]["details"]["attentive"]
    assert att["num_val"] == 10 and att["num_fit"] == 50 and att["num_heads"] == 2 and att["tokens"] == [16, 192]
    assert r["results"]["pixels"]["details"]["attentive"]["tokens"] == [16, 192]  # the ViT's 8 px patches, 3 x 8 x 8
    # the run's kNN is what its trunk gives when computed directly
    assert r["results"][str(cnn_run)]["metrics"]["knn_k5"]["value"] == pytest.approx(_direct_knn(cnn_run, 5))
    # intervals around their figure; draws carry their spread
    m = r["results"]["pixels"]["metrics"]
    assert m["knn_k20"]["low"] <= m["knn_k20"]["value"] <= m["knn_k20"]["high"]
    assert len(m["fewshot_1"]["draws"]) == 2
    few = r["results"]["pixels"]["details"]["fewshot"]
    assert few["num_val"] == 10 and len(few["chosen_c"]["fewshot_1"]) == 2  # C chosen on validation, per draw
    assert set(few["chosen_c"]["fewshot_1"] + few["chosen_c"]["fewshot_all"]) <= {0.1, 1.0, 10.0}
    # a ViT's grid covers DINOv2's feature choices, chosen on validation
    lin = r["results"][str(vit_run)]["details"]["linear"]
    assert {g["features"] for g in lin["grid"]} == {"cls", "cls+avg", "cls_last2", "cls_last2+avg"}
    assert lin["num_val"] == 10 and lin["num_fit"] == 50 and lin["chosen"]["features"] in {g["features"] for g in
                                                                                         lin["grid"]}
    # every metric has a best and its comparisons; the table marks the best in bold
    assert set(r["comparisons"]) == wanted | {"attentive"}
    assert "**" in stdout and str(cnn_run) in (out / "results.md").read_text()
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(names) * len(wanted) + 3  # attentive: the ViT, its random twin, the pixels


def test_the_cache_serves_every_later_call_and_never_a_stale_weight(cnn_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(cnn_run, run)
    cache = tmp_path / "cache"
    args = [f"backbones=[{run}]", "protocols=[knn]", f"bench.cache_dir={cache}"]
    assert bench(*args, f"output={tmp_path / 'a'}")[0] == 0
    entries = FeatureCache(str(cache)).entries()
    assert len(entries) == 2  # train and test
    stamps = {e["key"]: os.stat(cache / e["key"] / "meta.json").st_mtime_ns for e in entries}
    code, stdout, _ = run_sslkit("bench", *QUICK, *args, "--dry-run")
    assert code == 0 and "cached 2 of 2" in stdout
    assert bench(*args, f"output={tmp_path / 'b'}")[0] == 0
    assert {e["key"]: os.stat(cache / e["key"] / "meta.json").st_mtime_ns
            for e in FeatureCache(str(cache)).entries()} == stamps  # read, not written again
    assert _results(tmp_path / "a")["results"][str(run)]["metrics"] == _results(tmp_path / "b")["results"][
        str(run)]["metrics"]
    # a changed weight: new features, computed from the new weights
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest.txt").read_text().strip()
    state = torch.load(ckpt, weights_only=True)
    key = next(k for k in state["model"] if k.startswith("trunk.") and state["model"][k].ndim == 4)
    state["model"][key] = -state["model"][key]
    torch.save(state, ckpt)
    assert bench(*args, f"output={tmp_path / 'c'}")[0] == 0
    assert len(FeatureCache(str(cache)).entries()) == 4
    assert _results(tmp_path / "c")["results"][str(run)]["metrics"]["knn_k5"]["value"] == pytest.approx(
        _direct_knn(run, 5))


def test_a_changed_image_is_a_new_feature_set_and_unreadable_ones_are_left_out(tmp_path: Path) -> None:
    photo_folder(tmp_path / "data" / "train", 24)  # classes c0 and c1, and one corrupt JPEG in each split
    photo_folder(tmp_path / "data" / "test", 12)
    cache = tmp_path / "cache"
    args = ["data=folder", f"data.train.path={tmp_path / 'data' / 'train'}",
            f"data.test.path={tmp_path / 'data' / 'test'}", "data.image_size=16", "backbones=[pixels]",
            "protocols=[knn]", f"bench.cache_dir={cache}", "machine.device=cpu", "bench.num_workers=0",
            "bench.knn.ks=[3]", "bench.bootstrap=50"]
    code, _, stderr = run_sslkit("bench", *args, f"output={tmp_path / 'a'}")
    assert code == 0, stderr[-2000:]
    r = _results(tmp_path / "a")
    assert r["data"]["train"]["unreadable"] == ["c1/broken.jpg"] and r["data"]["test"]["size"] == 13  # (files; 12 read)
    assert r["results"]["pixels"]["details"]["knn"]["num_train"] == 24
    before = {e["entry"]: e["key"] for e in FeatureCache(str(cache)).entries()}
    test_images = sorted((tmp_path / "data" / "test" / "c1").glob("*.jpg"))
    shutil.copy(sorted((tmp_path / "data" / "test" / "c0").glob("*.jpg"))[0], test_images[0])
    assert run_sslkit("bench", *args, f"output={tmp_path / 'b'}")[0] == 0
    after: dict[str, set[str]] = {}
    for e in FeatureCache(str(cache)).entries():
        after.setdefault(e["entry"], set()).add(e["key"])
    assert after["train"] == {before["train"]}  # the train images did not change: served from the cache
    assert len(after["test"]) == 2 and before["test"] in after["test"]


@pytest.mark.parametrize(("args", "words"), [
    (["backbones=[/no/such/run, pixels]"], "/no/such/run"),
    (["backbones=[pixels]", "protocols=[knn, lineer]"], "Did you mean 'linear'"),
    (["backbones=[pixels]", "protocols=[dense]", "eval.dense.dataset=folder"], "protocols=dense"),
    (["backbones=[vit_tiny@/no/file.pth]"], "vit_tiny@/no/file.pth"),
    (["backbones=[]"], "no backbones"),
    (["backbones=[pixels,pixels]"], "listed twice"),
    (["backbones=[pixels,random]"], "none is listed"),
])
def test_bad_input_is_a_message_and_exit_2_before_any_extraction(args: list[str], words: str, tmp_path: Path) -> None:
    code, _, stderr = bench(*args, f"output={tmp_path / 'out'}", f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 2 and words in stderr and "Traceback" not in stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_the_attentive_probe_on_a_cnn_is_refused_before_any_extraction(cnn_run: Path, tmp_path: Path) -> None:
    """The attentive probe reads patch tokens, which a CNN has not (the dense probe reads its feature map)."""
    code, _, stderr = bench(f"backbones=[pixels, {cnn_run}]", "protocols=[knn, attentive]",
                            f"output={tmp_path / 'out'}", f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 2 and "protocols=attentive" in stderr and str(cnn_run) in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and not (tmp_path / "cache").exists()


def test_the_dense_protocol_on_fashion_mnist_scenes(vit_run: Path, cnn_run: Path, tmp_path: Path) -> None:
    """A ViT's patch tokens, a CNN's last feature map and the pixels' patches, each under the dense linear probe."""
    from sslkit.data.sources import DEBIAN_FASHION_MNIST
    from sslkit.models.dense import dense_features
    from sslkit.tools.pretrained import load_pretrained

    if not Path(DEBIAN_FASHION_MNIST).is_dir():
        pytest.skip("no Fashion-MNIST here (apt-get install dataset-fashion-mnist)")
    out, cache = tmp_path / "out", tmp_path / "cache"
    code, _, stderr = bench(f"backbones=[{vit_run}, {cnn_run}, pixels, random]", "protocols=[dense]", *SCENES,
                            f"output={out}", f"bench.cache_dir={cache}")
    assert code == 0, stderr[-3000:]
    r = _results(out)
    for name in (str(vit_run), str(cnn_run), "pixels", "random (vit_tiny)", "random (small_cnn)"):
        m = r["results"][name]["metrics"]["dense_miou"]
        assert 0.0 <= m["low"] <= m["value"] <= m["high"] <= 1.0, name
        d = r["results"][name]["details"]["dense"]
        assert d["num_train"] == 24 and d["num_test"] == 12 and len(d["train_loss"]) == 2
        assert len(d["per_class_iou"]) == 11 and d["miou"] == pytest.approx(m["value"])
    # the run's 8 px patches on the 56 px scenes: a 7 x 7 map of its width; the pixels cut in the same patches
    assert r["results"][str(vit_run)]["details"]["dense"]["feature_map"] == [192, 7, 7]
    assert r["results"]["pixels"]["details"]["dense"]["feature_map"] == [64, 7, 7]
    # the small CNN (width 8): its last convolutions' 64 channels at a stride of 8, what dense_features reads
    pre = load_pretrained(str(cnn_run), ["machine.device=cpu"])
    with torch.no_grad():
        fmap = dense_features(pre.trunk.eval(), torch.zeros(1, 3, 56, 56)).map
    assert r["results"][str(cnn_run)]["details"]["dense"]["feature_map"] == [fmap.shape[3], *fmap.shape[1:3]]
    assert "dense_miou" in r["comparisons"]
    entries = {e["entry"] for e in FeatureCache(str(cache)).entries()}
    assert {"dense/train", "dense/test"} <= entries
    # a folder whose class maps do not fit their images: named, before anything is extracted
    from helpers import ade_folder
    from PIL import Image

    root = ade_folder(tmp_path / "ade")
    Image.new("L", (8, 8)).save(root / "annotations" / "training" / "ADE_0002.png")
    code, _, stderr = bench("backbones=[pixels]", "protocols=[dense]", "eval.dense.dataset=folder",
                            f"eval.dense.path={root}", "eval.dense.num_classes=2", f"output={tmp_path / 'x'}",
                            f"bench.cache_dir={tmp_path / 'cache2'}")
    assert code == 2 and "protocols=dense" in stderr and "ADE_0002.jpg" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "cache2").exists()


def test_a_corrupt_checkpoint_names_the_backbone(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    code, _, stderr = bench(f"backbones=[{bad}, pixels]", f"output={tmp_path / 'out'}",
                            f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 2 and str(bad) in stderr and "nothing was extracted" in stderr
    assert not (tmp_path / "out").exists()


def test_unlabelled_data_names_the_dataset_and_the_protocols(tmp_path: Path) -> None:
    from helpers import photo

    (tmp_path / "flat").mkdir()
    for i in range(6):
        photo(20, 20, i).save(tmp_path / "flat" / f"{i}.jpg")
    code, _, stderr = run_sslkit("bench", "backbones=[pixels]", "data=folder", f"data.train.path={tmp_path / 'flat'}",
                                 f"data.test.path={tmp_path / 'flat'}", "machine.device=cpu",
                                 f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 2 and "flat" in stderr and "knn" in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_one_backbone_failing_mid_bench_keeps_the_others(cnn_run: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import sslkit.tools.bench.main as M

    real = M.extract_arrays

    def failing(module, *a, **k):
        if module is None:
            raise RuntimeError("the disk went away")
        return real(module, *a, **k)

    monkeypatch.setattr(M, "extract_arrays", failing)
    out = tmp_path / "out"
    code, _, _ = bench(f"backbones=[pixels, {cnn_run}]", "protocols=[knn]", f"output={out}",
                       f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 1
    r = _results(out)
    assert "the disk went away" in r["results"]["pixels"]["error"]
    assert "knn_k5" in r["results"][str(cnn_run)]["metrics"]
    assert "failed: RuntimeError: the disk went away" in (out / "results.md").read_text()


def test_compare_lines_up_results_folders(cnn_run: Path, tmp_path: Path) -> None:
    for name, ks in (("a", "[5]"), ("b", "[5,20]")):
        assert bench(f"backbones=[{cnn_run}, pixels]", "protocols=[knn]", f"output={tmp_path / name}",
                     f"bench.knn.ks={ks}", f"bench.cache_dir={tmp_path / 'cache'}")[0] == 0
    code, stdout, _ = run_sslkit("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
                                 f"output={tmp_path / 'both.md'}")
    assert code == 0 and (tmp_path / "both.md").read_text() == stdout
    header = stdout.splitlines()[0]
    assert "knn_k5" in header and "knn_k20" in header
    rows = [line for line in stdout.splitlines() if line.startswith("| [")]
    assert len(rows) == 4 and rows[0].startswith("| [1] |") and rows[-1].startswith("| [2] |")
    code, _, stderr = run_sslkit("bench", "compare", str(tmp_path / "nothing"))
    assert code == 2 and "results.json" in stderr


def test_weights_files_of_an_sslkit_vit_and_a_timm_model(tmp_path: Path) -> None:
    import timm

    from sslkit import registry as R

    torch.manual_seed(0)
    vit = R.get(R.TRUNKS, "vit_tiny")(in_channels=3, img_size=32, patch_size=8)
    torch.save(vit.state_dict(), tmp_path / "vit.pth")
    cnn = timm.create_model("resnet10t", pretrained=False, num_classes=0)
    torch.save(cnn.state_dict(), tmp_path / "r10.pth")
    out = tmp_path / "out"
    specs = [f"timm:resnet10t@{tmp_path / 'r10.pth'}", f"vit_tiny@{tmp_path / 'vit.pth'}"]
    code, _, stderr = bench(f"backbones=[{', '.join(specs)}, random]", "protocols=[knn, linear]", f"output={out}",
                            f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 0, stderr[-2000:]
    r = _results(out)
    assert r["backbones"] == [*specs, "random (timm:resnet10t)", "random (vit_tiny)"]
    assert r["results"][specs[0]]["backbone"]["kind"] == "timm" and r["results"][specs[1]]["backbone"]["kind"] == (
        "weights")
    assert {g["features"] for g in r["results"][specs[1]]["details"]["linear"]["grid"]} == {
        "cls", "cls+avg", "cls_last4", "cls_last4+avg"}
    # an architecture the file does not fit is refused before anything is extracted
    code, _, stderr = bench(f"backbones=[vit_small@{tmp_path / 'vit.pth'}]", f"output={tmp_path / 'x'}",
                            f"bench.cache_dir={tmp_path / 'cache2'}")
    assert code == 2 and "vit_small@" in stderr and not (tmp_path / "cache2").exists()


@pytest.mark.multiprocess
def test_one_and_two_processes_give_the_same_table(cnn_run: Path, vit_run: Path, tmp_path: Path) -> None:
    """distributed.nproc_per_node=2 (gloo): each process extracts every other image, rank 0 puts them back in order,
    runs the protocols and writes the same figures one process does."""
    common = (f"backbones=[{cnn_run}, {vit_run}, pixels]", "bench.robustness.corruptions=[gaussian_noise]")
    code, _, stderr = bench(*common, f"output={tmp_path / 'one'}", f"bench.cache_dir={tmp_path / 'c1'}")
    assert code == 0, stderr[-2000:]
    code, _, stderr = bench(*common, "distributed.nproc_per_node=2", f"output={tmp_path / 'two'}",
                            f"bench.cache_dir={tmp_path / 'c2'}")
    assert code == 0, stderr[-2000:]
    one, two = _results(tmp_path / "one"), _results(tmp_path / "two")
    assert two["processes"] == 2
    for name in one["backbones"]:
        assert two["results"][name]["metrics"] == one["results"][name]["metrics"], name
        for entry, key in one["results"][name]["cache"].items():
            a = FeatureCache(str(tmp_path / "c1")).load(key)
            b = FeatureCache(str(tmp_path / "c2")).load(two["results"][name]["cache"][entry])
            assert a is not None and b is not None and set(a) == set(b)
            for array in a:
                assert np.allclose(a[array], b[array], atol=1e-6), (name, entry, array)


def test_a_list_the_shell_split_at_its_spaces_is_one_argument(cnn_run: Path, tmp_path: Path) -> None:
    code, _, stderr = bench("backbones=[pixels,", f"{cnn_run}]", "protocols=[knn]", f"output={tmp_path / 'out'}",
                            f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 0, stderr[-2000:]
    assert _results(tmp_path / "out")["backbones"] == ["pixels", str(cnn_run)]


def test_a_training_run_ends_with_its_bench_and_its_report_links_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_main("config=simclr", *TINY, "log.report=true", "eval.bench.at_end=[knn,retrieval]",
             "eval.bench.backbones=[pixels]", f"eval.bench.cache_dir={tmp_path / 'cache'}", "eval.bench.knn.ks=[5]",
             "eval.bench.bootstrap=50", "eval.bench.num_workers=0", f"output_dir={out}")
    r = _results(out / "bench")
    assert r["backbones"] == [str(out), "pixels"] and r["protocols"] == ["knn", "retrieval"]
    assert {"knn_k5", "map_at_r"} <= set(r["results"][str(out)]["metrics"])
    report = (out / "report.md").read_text()
    assert "[bench/results.md](bench/results.md)" in report and "knn_k5" in report and "beside pixels" in report


def test_a_runs_own_bench_settings_do_not_stop_its_evaluation(cnn_run: Path, tmp_path: Path) -> None:
    """A run trained with bench keys since renamed (its stored config has eval.bench.fewshot.c) is still read."""
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    shutil.copytree(cnn_run, run)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest.txt").read_text().strip()
    state = torch.load(ckpt, weights_only=True)
    cfg = OmegaConf.create(state["config"])
    OmegaConf.set_struct(cfg, False)
    cfg.eval.bench = {"fewshot": {"c": 1.0}}
    state["config"] = OmegaConf.to_yaml(cfg)
    torch.save(state, ckpt)
    code, _, stderr = bench(f"backbones=[{run}]", "protocols=[knn]", f"output={tmp_path / 'out'}",
                            f"bench.cache_dir={tmp_path / 'cache'}")
    assert code == 0, stderr[-2000:]


def test_a_batch_is_transformed_together_into_exactly_the_images_one_by_one() -> None:
    """The loader fetches whole batches (BenchImages.__getitems__): the same values as item by item, for every
    transform (resize, crop, normalisation, channels), under a corruption, with an unreadable image among them."""
    from torch.utils.data import Subset

    from sslkit.data.sources import UnreadableSampleError
    from sslkit.tools.bench.cache import BenchImages

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (12, 1, 30, 30), dtype=torch.uint8, generator=g)

    class Source(torch.utils.data.Dataset):
        channels = 1

        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int):
            if i == 4:
                raise UnreadableSampleError("img4.png: broken")
            return images[i].clone(), i % 3

    transforms = [{"image_size": 28, "mean": [0.5], "std": [0.5], "resize": None, "crop_pct": None, "channels": 3},
                  {"image_size": 16, "mean": [0.4, 0.5, 0.6], "std": [0.2, 0.3, 0.4], "resize": 20, "crop_pct": None,
                   "channels": 3},
                  {"image_size": 24, "mean": None, "std": None, "resize": None, "crop_pct": 0.875, "channels": None}]
    for t in transforms:
        for corruption in (None, ("gaussian_noise", 3, "cifar")):
            data = BenchImages(Source(), t, corruption, seed=1)
            asked = [5, 0, 4, 11, 3]
            x, y, index = data.__getitems__(asked)
            assert index.tolist() == asked and y.tolist() == [2, 0, -1, 2, 0]
            for j, i in enumerate(asked):
                assert torch.equal(x[j], data[i][0]), (t, corruption, i)
            assert torch.equal(Subset(data, list(range(12))).__getitems__(asked)[0], x)
            # a source under a Subset (data.limit, a seeded split): the unreadable image's blank keeps its channels
            below = BenchImages(Subset(Source(), list(range(12))), t, corruption, seed=1)
            assert torch.equal(below.__getitems__(asked)[0], x)


def test_data_without_a_test_split_gets_a_stated_seeded_one(tmp_path: Path) -> None:
    photo_folder(tmp_path / "data", 40)  # one folder of class folders, no test split
    args = ["data=folder", f"data.train.path={tmp_path / 'data'}", "data.image_size=16", "backbones=[pixels]",
            "protocols=[knn]", f"bench.cache_dir={tmp_path / 'cache'}", "machine.device=cpu", "bench.num_workers=0",
            "bench.knn.ks=[3]", "bench.bootstrap=50", "bench.test_fraction=0.25"]
    code, _, stderr = run_sslkit("bench", *args, f"output={tmp_path / 'a'}")
    assert code == 0, stderr[-2000:]
    r = _results(tmp_path / "a")
    data = r["data"]
    assert data["test_split"] == "a stratified 0.25 of the train split, seed 0"
    assert data["train"]["size"] + data["test"]["size"] == 41 and data["test"]["size"] == 10  # 20 + 21 files: 5 + 5
    unreadable = data["train"].get("unreadable", []) + data["test"].get("unreadable", [])
    assert unreadable == ["c1/broken.jpg"]  # in one of the two parts, left out, named
    assert r["results"]["pixels"]["details"]["knn"]["num_train"] == data["train"]["size"] - len(
        data["train"].get("unreadable", []))
    assert run_sslkit("bench", *args, "bench.seed=1", f"output={tmp_path / 'b'}")[0] == 0
    assert _results(tmp_path / "b")["data"]["test"]["fingerprint"] != data["test"]["fingerprint"]  # another draw
