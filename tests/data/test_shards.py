"""data=webdataset: tar shards read by global index through a cached index of member offsets; ``sslkit data pack``
gives back every image bit for bit; a stale index is rebuilt; a missing, truncated or image-less shard stops the
run naming it; a corrupt member is skipped and counted; through the CLI, a SIGKILLed run resumes bit-identically and
an elastic resume on 1 and 4 processes reads the same samples at every step."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL_WDS, four_shards, photo_folder, run_main, run_sslkit
from PIL import Image

from sslkit.data.shards import INDEX_SUFFIX, ShardDataset, expand_shards, pack_images, shard_index
from sslkit.data.sources import DataSourceError, FolderDataset, UnreadableSampleError


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A class-folder tree of 96 JPEGs and PNGs of many sizes (and one corrupt JPEG), packed with ``sslkit data
    pack`` into shards of about 40 kB: (the image folder, the shard folder)."""
    root = tmp_path_factory.mktemp("shards")
    photo_folder(root / "images", n=96)
    code, out, err = run_sslkit("data", "pack", f"input={root / 'images'}", f"output={root / 'shards'}",
                                "shard_mb=0.04")
    assert code == 0, err
    assert "packed 97 images (2 classes)" in out
    return root / "images", root / "shards"


def test_pack_then_read_gives_back_every_image_bit_for_bit_with_its_label(packed: tuple[Path, Path]) -> None:
    images, shards = packed
    folder = FolderDataset(images, probe=0)
    ds = ShardDataset(str(shards))
    assert len(ds.shards) >= 3 and len(ds) == len(folder) == 97 and ds.num_classes == 2
    assert all(Path(f"{s}{INDEX_SUFFIX}").is_file() for s in ds.shards)  # each shard's index beside it
    for i, (path, label) in enumerate(folder.samples):
        assert ds.raw(i) == Path(path).read_bytes(), path
        assert int(ds.labels[i]) == label
    readable = [i for i, (p, _) in enumerate(folder.samples) if "broken" not in p]
    for i in readable[::17]:
        torch.testing.assert_close(ds[i][0], folder[i][0], rtol=0, atol=0)
    broken = next(i for i, (p, _) in enumerate(folder.samples) if "broken" in p)
    with pytest.raises(UnreadableSampleError, match=r"cannot decode sample \d+ of shard"):
        ds[broken]  # skipped and counted by the dataset wrapper, as a folder's
    ds.jpeg_bytes = True  # data.decode_on=device: a JPEG's bytes as stored, a PNG decoded here
    jpeg = next(i for i in readable if folder.samples[i][0].endswith(".jpg"))
    assert bytes(ds[jpeg][0].numpy()) == Path(folder.samples[jpeg][0]).read_bytes()


def test_a_brace_pattern_a_list_file_and_a_folder_name_the_same_shards(packed: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    _, shards = packed
    files = sorted(shards.glob("*.tar"))
    pattern = str(shards / f"shard-{{000000..{len(files) - 1:06d}}}.tar")
    (tmp_path / "list.txt").write_text("".join(f"{f}\n" for f in files))
    assert expand_shards(pattern) == expand_shards(str(tmp_path / "list.txt")) == expand_shards(str(shards)) == files


def test_an_index_older_than_its_shard_is_rebuilt(tmp_path: Path) -> None:
    files = []
    for i in range(3):
        buf = io.BytesIO()
        Image.new("RGB", (8 + i, 8), (i * 40, 0, 0)).save(buf, format="PNG")
        files.append(tmp_path / f"{i}.png")
        files[-1].write_bytes(buf.getvalue())
    (shard,) = pack_images([(str(f), -1) for f in files], tmp_path / "s")
    assert len(shard_index(shard)["offsets"]) == 3
    (shard2,) = pack_images([(str(f), -1) for f in files[:2]], tmp_path / "s2")
    shutil.copy(shard2, shard)  # the shard rewritten with 2 samples; its cached index says 3
    os.utime(shard, ns=(1, 1))
    assert len(shard_index(shard)["offsets"]) == 2
    assert len(ShardDataset(str(shard)).labels) == 2 and ShardDataset(str(shard)).num_classes == 0


def test_missing_truncated_and_imageless_shards_stop_with_their_name(packed: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    from sslkit.config.compose import compose_config
    from sslkit.config.schema import ConfigError

    _, shards = packed
    first = sorted(shards.glob("*.tar"))[0]
    cut = tmp_path / "cut.tar"
    cut.write_bytes(first.read_bytes()[:1500])  # a header and part of a member
    with pytest.raises(DataSourceError, match=r"shard .*cut.tar cannot be read as a tar file"):
        ShardDataset(str(cut))
    with tarfile.open(tmp_path / "text.tar", "w") as tar:
        info = tarfile.TarInfo("0.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(DataSourceError, match=r"text.tar holds no image member"):
        ShardDataset(str(tmp_path / "text.tar"))
    shutil.copy(first, tmp_path / "x-000000.tar")
    with pytest.raises(ConfigError, match=r"2 of its 3 shard\(s\) do not exist .*x-000001.tar"):
        compose_config(["config=simclr", "data=webdataset", "machine.device=cpu",
                        f"data.train.path='{tmp_path}/x-{{000000..000002}}.tar'"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"names no .tar shard"):
        compose_config(["config=simclr", "data=webdataset", "machine.device=cpu", f"data.train.path={tmp_path}/empty"])
    with pytest.raises(ConfigError, match=r"'data.train.path' must be set for the webdataset source"):
        compose_config(["config=simclr", "data=webdataset", "machine.device=cpu"])


def test_the_shard_order_is_a_permutation_that_reads_span_shards_at_a_time_from_the_seed_alone() -> None:
    from sslkit.data.sampler import StatefulDistributedSampler, grouped_order

    starts = [0, 10, 25, 30, 47]  # 5 shards of 10, 15, 5, 17 and 13 samples: 60
    order = grouped_order(60, starts, 2, seed=3)
    assert sorted(order.tolist()) == list(range(60)) and torch.equal(order, grouped_order(60, starts, 2, seed=3))
    assert not torch.equal(order, grouped_order(60, starts, 2, seed=4))
    shard_of = np.searchsorted(starts, np.arange(60), side="right") - 1
    sizes = np.diff([*starts, 60])
    windows, seen = [], set()
    for position, index in enumerate(order.tolist()):  # cut the order where the shards seen so far are complete
        seen.add(int(shard_of[index]))
        if position + 1 == sum(int(sizes[k]) for k in {*seen, *(w for ws in windows for w in ws)}):
            windows.append(seen)
            seen = set()
    assert not seen and all(len(w) <= 2 for w in windows) and len(windows) == 3  # 5 shards, 2 at a time
    a = StatefulDistributedSampler(60, 2, 0, seed=3, groups=starts, group_span=2)
    b = StatefulDistributedSampler(60, 2, 1, seed=3, groups=starts, group_span=2)
    assert sorted(a.epoch_indices() + b.epoch_indices()) == list(range(60))
    with pytest.raises(ValueError, match="groups must be ascending"):
        StatefulDistributedSampler(60, groups=[5, 10])


def test_data_info_says_what_a_source_holds(packed: tuple[Path, Path]) -> None:
    images, shards = packed
    code, out, err = run_sslkit("data", "info", f"path={shards}", "sample=200")
    assert code == 0, err
    assert f"{shards} (webdataset): 97 samples, 2 classes" in out
    assert "height 24-42" in out and "unreadable among them: 1" in out and "cannot decode sample" in out
    code, out, _ = run_sslkit("data", "info", f"path={images}")
    assert code == 0 and "(folder): 97 samples, 2 classes" in out
    code, _, err = run_sslkit("data", "pack", f"input={images}", f"output={shards}")
    assert code == 2 and "holds shards already" in err




def test_a_run_trains_on_shards_through_the_cli_skipping_the_corrupt_member(packed: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    _, shards = packed
    proc = run_main(*SMALL_WDS, f"data.train.path={shards}", "data.batch_size=16", "optim.epochs=1",
                    "data.num_workers=2", f"output_dir={tmp_path / 'run'}")
    text = proc.stdout + proc.stderr
    assert "97 samples, 2 classes" in text and "1 of 96 samples" in text  # the corrupt JPEG, counted


@pytest.mark.slow
@pytest.mark.parametrize("order", ["random", "shards"])
def test_a_run_killed_mid_epoch_resumes_bit_identically(packed: tuple[Path, Path], tmp_path: Path,
                                                        order: str) -> None:
    """96 of the 97 samples in batches of 16 (6 steps an epoch, 2 epochs), a checkpoint every 4 steps, SIGKILL after
    step 10 (a process of its own, 2 loader workers): resumed from update 8, mid-epoch, it ends bit-identical, in
    either order (a permutation of all samples, or shard by shard)."""
    from reliability_helpers import killed_at_10_resumes_identically

    _, shards = packed
    args = [*SMALL_WDS, f"data.train.path={shards}", f"data.order={order}", "data.shard_span=2",
            "data.batch_size=16", "optim.epochs=2",
            "checkpoint.every_n_steps=4", "checkpoint.keep_last=0", "eval.knn.enabled=false", "data.num_workers=2",
            "imports=[sslkit_faults]"]
    killed_at_10_resumes_identically(args, "simclr", tmp_path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_elastic_resume_on_one_and_four_processes_reads_the_same_samples_at_every_step(
        tmp_path: Path) -> None:
    """128 samples in 4 shards read shard by shard (data.order=shards, 2 at a time), a 2-process run (global batch 32:
    4 steps an epoch, 2 epochs) crashed after step 5 resumes on 1 and on 4 processes from its checkpoint of step 3:
    every later step reads the samples the uninterrupted run read (the order a function of the seed and epoch
    alone). (data.order=random, the sampler's permutation, is the folder's and hf's elastic test.)"""
    from dist_workers import assert_resumed_as_uninterrupted, elastic_steps

    four_shards(tmp_path)
    args = [*SMALL_WDS, f"data.train.path={tmp_path / 'shards'}", "data.order=shards", "data.shard_span=2",
            "data.global_batch_size=32", "optim.epochs=2",
            "checkpoint.every_n_steps=3", "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0",
            "eval.knn.enabled=false", "data.num_workers=0", "imports=[sslkit_faults]"]
    expected, resumed = elastic_steps(args, tmp_path)
    assert_resumed_as_uninterrupted(expected, resumed)
    starts = ShardDataset(str(tmp_path / "shards")).starts
    for step in range(4):  # each step's 32 samples come from the 2 shards of its window
        assert len({int(np.searchsorted(starts, i, side="right")) for i in expected[step]}) <= 2, step
