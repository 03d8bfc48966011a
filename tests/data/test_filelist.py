"""The filelist source: CSV or text lists of images, labelled or not, and the errors a list can cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from sslkit.data.sources import DataSourceError, UnreadableSampleError, build_source
from tests.helpers import SMALL, metrics, photo, run_main


def _images(root: Path, n: int = 6) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        f = root / f"img{i}.{'png' if i % 3 == 0 else 'jpg'}"
        photo(20 + i, 24, i).save(f)
        files.append(f)
    return files


def test_csv_with_header_and_integer_labels(tmp_path: Path) -> None:
    files = _images(tmp_path / "imgs")
    lst = tmp_path / "train.csv"
    lst.write_text("path,label\n" + "".join(f"imgs/{f.name},{i % 3 + 2}\n" for i, f in enumerate(files)))
    ds = build_source("filelist", "train", str(lst))
    assert len(ds) == 6 and ds.num_classes == 5  # labels 2..4 used as they are
    assert [label for _, label in ds.samples] == [2, 3, 4, 2, 3, 4]
    image, label = ds[1]
    assert image.shape == (3, 21, 24) and label == 3


def test_text_list_with_class_names_absolute_and_relative_paths(tmp_path: Path) -> None:
    files = _images(tmp_path / "imgs", 4)
    lst = tmp_path / "lists" / "train.txt"
    lst.parent.mkdir()
    lines = ["# a comment", "", f"{files[0]} zebra", f"../imgs/{files[1].name} ant", f"{files[2]} zebra",
             f"../imgs/{files[3].name} bee"]
    lst.write_text("\n".join(lines) + "\n")
    ds = build_source("filelist", "train", str(lst), channels=1)
    assert ds.classes == ["ant", "bee", "zebra"] and [label for _, label in ds.samples] == [2, 0, 2, 1]
    assert ds[1][0].shape[0] == 1


def test_unlabelled_list_is_pretraining_data(tmp_path: Path) -> None:
    files = _images(tmp_path / "imgs", 3)
    lst = tmp_path / "all.txt"
    lst.write_text("".join(f"{f}\n" for f in files))
    ds = build_source("filelist", "train", str(lst))
    assert ds.num_classes == 0 and all(label == -1 for _, label in ds.samples)


@pytest.mark.parametrize("content, words", [
    ("imgs/img0.png,1\nimgs/nothere.jpg,0\nimgs/gone.jpg,1\n", ["2 of the 3 files", "train.csv:2", "nothere.jpg"]),
    ("imgs/img0.png,1\nimgs/img1.jpg\n", ["train.csv:2", "no label"]),
    ("# only a comment\n", ["names no image"]),
    ("imgs/img0.png,1,extra\n", ["train.csv:1", "3 fields"]),
])
def test_bad_lists_say_what_and_where(tmp_path: Path, content: str, words: list[str]) -> None:
    _images(tmp_path / "imgs", 2)
    (tmp_path / "train.csv").write_text(content)
    with pytest.raises(DataSourceError) as exc:
        build_source("filelist", "train", str(tmp_path / "train.csv"))
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_a_spreadsheet_csv_with_a_byte_order_mark_keeps_its_header(tmp_path: Path) -> None:
    files = _images(tmp_path / "imgs", 2)
    lst = tmp_path / "train.csv"
    lst.write_text("path,label\n" + "".join(f"imgs/{f.name},cat\n" for f in files), encoding="utf-8-sig")
    ds = build_source("filelist", "train", str(lst))
    assert len(ds) == 2 and ds.classes == ["cat"]


def test_a_list_that_is_not_text_or_has_an_unknown_header_says_so(tmp_path: Path) -> None:
    files = _images(tmp_path / "imgs", 2)
    with pytest.raises(DataSourceError, match=r"img1\.jpg:1: not UTF-8 text.*data=folder"):
        build_source("filelist", "train", str(files[1]))  # an image given as the list
    lst = tmp_path / "train.csv"
    lst.write_text("filepath,class\n" + "".join(f"imgs/{f.name},0\n" for f in files))
    with pytest.raises(DataSourceError, match=r"(?s)train\.csv:1: .*filepath.*header, it must read 'path'"):
        build_source("filelist", "train", str(lst))


def test_a_corrupt_listed_image_is_unreadable_when_read(tmp_path: Path) -> None:
    files = _images(tmp_path / "imgs", 2)
    bad = tmp_path / "imgs" / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 32)
    lst = tmp_path / "l.csv"
    lst.write_text(f"{files[0]},0\n{bad},1\n{files[1]},0\n")
    ds = build_source("filelist", "train", str(lst))
    with pytest.raises(UnreadableSampleError):
        ds[1]


def test_pretraining_on_a_list_and_evaluating_on_labelled_lists(tmp_path: Path) -> None:
    """Unlabelled list for training; kNN at the end on labelled lists of their own (eval.data.*)."""
    files = _images(tmp_path / "imgs", 16)
    (tmp_path / "pretrain.txt").write_text("".join(f"{f}\n" for f in files))
    (tmp_path / "train.csv").write_text("".join(f"{f},{i % 2}\n" for i, f in enumerate(files[:10])))
    (tmp_path / "test.csv").write_text("".join(f"{f},{i % 2}\n" for i, f in enumerate(files[10:])))
    out = tmp_path / "run"
    run_main("config=simclr", *SMALL, "data=filelist", "data.train.kwargs={}",
             f"data.train.path={tmp_path / 'pretrain.txt'}",
             "model.trunk=small_cnn", "model.trunk_kwargs={width: 8}", "data.image_size=16", "data.batch_size=8",
             "data.eval_transform.resize=null", "optim.max_steps=2", "log.tensorboard=false",
             "eval.data.train.source=filelist", f"eval.data.train.path={tmp_path / 'train.csv'}",
             f"eval.data.test.path={tmp_path / 'test.csv'}", f"output_dir={out}")
    steps = [r["step"] for r in metrics(out) if r.get("phase") == "train"]
    knn = [r for r in metrics(out) if "knn_top1" in r]
    assert steps[-1] == 2 and len(knn) == 1 and 0 <= knn[0]["knn_top1"] <= 1


def test_config_check_names_a_missing_list(tmp_path: Path) -> None:
    proc = run_main("config=simclr", *SMALL, "data=filelist", f"data.train.path={tmp_path / 'nope.csv'}",
                    f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "nope.csv" in proc.stderr and "does not exist" in proc.stderr
    proc = run_main("config=simclr", *SMALL, "data=filelist", f"data.train.path={tmp_path}",
                    f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "is a folder" in proc.stderr and "data=folder" in proc.stderr
    assert "Traceback" not in proc.stderr
