"""data=hf: Hugging Face datasets on local disk (saved Dataset / DatasetDict, Parquet, Arrow; images as bytes or
paths), decoded as PIL decodes the same bytes; through the CLI; a SIGKILLed run resumes bit-identically mid-epoch;
an elastic resume on 1 and 4 processes reads the same rows at every step; and the config errors naming the key."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_main
from PIL import Image

datasets = pytest.importorskip("datasets")

from sslkit.data.hf import HFDataset  # noqa: E402
from sslkit.data.sources import DataSourceError, UnreadableSampleError  # noqa: E402


def _jpeg(i: int, size: tuple[int, int] = (36, 44)) -> bytes:
    pixels = (np.random.default_rng(i).random((*size, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _rows(n: int) -> dict:
    return {"image": [{"bytes": _jpeg(i), "path": None} for i in range(n)], "label": [i % 4 for i in range(n)]}


def _saved(root: Path, n: int = 96, split_dict: bool = True) -> Path:
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list("abcd"))})
    ds = datasets.Dataset.from_dict(_rows(n), features=features)
    (datasets.DatasetDict({"train": ds, "validation": ds.select(range(16))}) if split_dict else ds).save_to_disk(
        str(root))
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 JPEG rows with labels in 4 classes, train and validation splits, as datasets' save_to_disk writes them."""
    return _saved(tmp_path_factory.mktemp("hf") / "ds")


def _pil(data: bytes, mode: str) -> torch.Tensor:
    arr = np.asarray(Image.open(io.BytesIO(data)).convert(mode))
    t = torch.from_numpy(arr.copy())
    return t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)


def test_rows_decode_as_pil_decodes_their_bytes_with_their_labels_and_the_splits_by_name(saved: Path) -> None:
    train = HFDataset(saved, "train", label_column="label")
    assert len(train) == 96 and train.num_classes == 4 and train.classes == list("abcd")
    for i in (0, 37, 95):
        image, label = train[i]
        assert image.dtype == torch.uint8 and torch.equal(image, _pil(_jpeg(i), "RGB")) and label == i % 4
    gray, _ = HFDataset(saved, "train", channels=1)[5]
    assert torch.equal(gray, _pil(_jpeg(5), "L"))
    assert HFDataset(saved, "train")[3][1] == -1  # no label column: -1
    assert len(HFDataset(saved, "test", label_column="label")) == 16  # sslkit's test split: "validation"
    train.jpeg_bytes = True  # data.decode_on=device: the JPEG's bytes as they are
    raw, _ = train[7]
    assert raw.ndim == 1 and bytes(raw.numpy()) == _jpeg(7)


def test_parquet_and_arrow_files_and_images_given_by_path(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"img": [_jpeg(i) for i in range(6)], "y": list(range(6))})
    ds.to_parquet(str(tmp_path / "part-0.parquet"))
    from_parquet = HFDataset(tmp_path, "train", image_column="img", label_column="y")
    assert len(from_parquet) == 6 and from_parquet.num_classes == 6
    assert torch.equal(from_parquet[4][0], _pil(_jpeg(4), "RGB"))
    files = tmp_path / "files"
    files.mkdir()
    for i in range(3):
        (files / f"{i}.jpg").write_bytes(_jpeg(i))
    by_path = datasets.Dataset.from_dict({"file": [f"{i}.jpg" for i in range(3)]})
    by_path.save_to_disk(str(files / "table"))
    shutil.copy(files / "0.jpg", files / "table" / "0.jpg")  # paths are relative to the dataset folder
    with_paths = HFDataset(files / "table", "train", image_column="file")
    assert torch.equal(with_paths[0][0], _pil(_jpeg(0), "RGB"))
    with pytest.raises(UnreadableSampleError, match=r"1\.jpg"):  # a missing file: that row skipped and counted
        with_paths[1]


def test_bad_datasets_are_messages_naming_the_key(saved: Path, tmp_path: Path) -> None:
    from sslkit.data.hf import build_hf

    with pytest.raises(DataSourceError, match=r"data.train.path: .* has no column 'img' \(data.train.kwargs."
                                              r"image_column\); its columns: image, label"):
        build_hf("train", str(saved), image_column="img")
    with pytest.raises(DataSourceError, match=r"no column 'cls' \(data.train.kwargs.label_column\)"):
        build_hf("train", str(saved), label_column="cls")
    with pytest.raises(DataSourceError, match=r"needs a dataset folder or files: set data\.test\.path"):
        build_hf("test", None)
    with pytest.raises(DataSourceError, match="is not a Hugging Face dataset"):
        build_hf("train", str(tmp_path))
    only = datasets.DatasetDict({"extra": datasets.Dataset.from_dict(_rows(2))})
    only.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataSourceError, match="holds the splits extra, none of them named train"):
        build_hf("train", str(tmp_path / "dd"))
    datasets.Dataset.from_dict({"image": [_jpeg(0)], "label": ["cat"]}).save_to_disk(str(tmp_path / "str"))
    with pytest.raises(DataSourceError, match="holds string, not integer class indices"):
        build_hf("train", str(tmp_path / "str"), label_column="label")


def test_a_missing_path_is_a_config_error_before_anything_is_written() -> None:
    from sslkit.config.compose import compose_config
    from sslkit.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"'data.train.path' must be set for the hf source"):
        compose_config(["config=simclr", "data=hf", "machine.device=cpu"])
    with pytest.raises(ConfigError, match=r"'data.train.path' = /no/such/dataset: does not exist; the hf source"):
        compose_config(["config=simclr", "data=hf", "data.train.path=/no/such/dataset", "machine.device=cpu"])


def test_without_the_datasets_library_the_message_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                       saved: Path) -> None:
    import builtins

    real = builtins.__import__

    def no_datasets(name: str, *args: object, **kwargs: object) -> object:
        if name == "datasets":
            raise ImportError("no datasets")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DataSourceError, match=r"pip install 'sslkit\[hf\]'"):
        HFDataset(saved, "train")


SMALL_HF = ["config=simclr", "data=hf", "machine.device=cpu", "data.train.kwargs.label_column=label",
            "model.trunk=small_cnn", "model.trunk_kwargs={width: 8}", "model.head.hidden_dim=32",
            "model.head.out_dim=16", "data.image_size=32", "data.small_image_size=16", "eval.knn.k=5",
            "log.tensorboard=false", "log.report=false"]


def test_a_run_trains_on_a_saved_dataset_through_the_cli_with_its_labels_for_knn(saved: Path,
                                                                                  tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_main(*SMALL_HF, f"data.train.path={saved}", "data.batch_size=16", "optim.max_steps=3",
                    "data.num_workers=2", f"output_dir={out}")
    assert "split train of a saved DatasetDict: 96 rows" in proc.stdout + proc.stderr
    assert "split validation of a saved DatasetDict: 16 rows" in proc.stdout + proc.stderr
    assert "knn_top1" in (out / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_bit_identically(saved: Path, tmp_path: Path) -> None:
    """96 rows in batches of 16 (6 steps an epoch, 2 epochs), a checkpoint every 4 steps, SIGKILL after step 10 (a
    process of its own, 2 loader workers): resumed from update 8, mid-epoch, it ends bit-identical."""
    from reliability_helpers import killed_at_10_resumes_identically

    args = [*SMALL_HF, f"data.train.path={saved}", "data.batch_size=16", "optim.epochs=2",
            "checkpoint.every_n_steps=4", "checkpoint.keep_last=0", "eval.knn.enabled=false", "data.num_workers=2",
            "imports=[sslkit_faults]"]
    killed_at_10_resumes_identically(args, "simclr", tmp_path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_elastic_resume_on_one_and_four_processes_reads_the_same_rows_at_every_step(tmp_path: Path) -> None:
    """A 2-process run (global batch 32 over 128 rows: 4 steps an epoch, 2 epochs) crashed after step 5 resumes on 1
    and on 4 processes from its checkpoint of step 3: every later step reads the rows the uninterrupted run read."""
    from dist_workers import assert_resumed_as_uninterrupted, elastic_steps

    data = _saved(tmp_path / "ds", n=128, split_dict=False)
    args = [*SMALL_HF, f"data.train.path={data}", "data.global_batch_size=32", "optim.epochs=2",
            "checkpoint.every_n_steps=3", "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0",
            "eval.knn.enabled=false", "data.num_workers=0", "imports=[sslkit_faults]"]
    assert_resumed_as_uninterrupted(*elastic_steps(args, tmp_path))
