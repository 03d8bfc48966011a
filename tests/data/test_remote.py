"""Tar shards in object storage, against real servers on localhost (an HTTP file server with byte ranges, moto's S3
server): every sample read by one ranged request gives back the local shard's bytes and labels; the index comes from
the file beside the shard, or from the tar headers once, cached by the shard's ETag; a flaky network is retried to
the same bytes; a server without byte ranges, a missing shard and a remote path for a local source are named; the
credentials never reach the run folder."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import HANG_S, SMALL_WDS, four_shards, photo_folder, run_main
from remote_servers import http_server, s3_server

from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.config.secrets import HIDDEN, hidden_value, redact_config, redact_overrides
from sslkit.data.remote import Remote, RemoteReadError, Retries
from sslkit.data.shards import INDEX_SUFFIX, ShardDataset, pack_images
from sslkit.data.sources import DataSourceError, FolderDataset

pytest.importorskip("aiohttp")
QUICK = Retries(attempts=5, base_s=0.01, max_s=0.05)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of 3+ shards of ~40 kB (48 images of many sizes, JPEG and PNG, 2 classes), each with its index."""
    root = tmp_path_factory.mktemp("remote")
    photo_folder(root / "images", n=48)
    folder = FolderDataset(root / "images", probe=0)
    pack_images([(p, label) for p, label in folder.samples], root / "shards", shard_bytes=40_000)
    return root / "shards"


def _pattern(base: str, shards: Path) -> str:
    n = len(list(shards.glob("*.tar")))
    return f"{base}/shard-{{000000..{n - 1:06d}}}.tar"


def _upload(options: dict, folder: Path, prefix: str) -> None:
    """Every file of ``folder`` to ``prefix`` (``s3://bucket[/path]``) on the S3 server ``options`` reach."""
    store = Remote("s3", options)
    store.fs.mkdir(prefix.split("://", 1)[1].split("/", 1)[0])
    for f in sorted(folder.iterdir()):
        store.put(f, f"{prefix}/{f.name}")


def _same_as_local(remote: ShardDataset, shards: Path) -> None:
    local = ShardDataset(str(shards))
    assert len(remote) == len(local) and remote.num_classes == local.num_classes == 2
    np.testing.assert_array_equal(remote.labels, local.labels)
    for i in range(len(local)):
        assert remote.raw(i) == local.raw(i), i


def test_a_batch_is_read_in_one_round_of_concurrent_ranged_requests(shards: Path, tmp_path: Path) -> None:
    """The loader asks for a batch at once (SSLDataset.__getitems__): its remote samples are requested together, the
    same bytes, and a store that fails the whole round is retried as one read."""
    from sslkit.data.dataset import SSLDataset

    with http_server(shards) as (base, faults):
        ds = ShardDataset(_pattern(base, shards), cache_dir=str(tmp_path / "cache"))
        ds.remote.retries = QUICK
        local = ShardDataset(str(shards))
        batch = [0, 17, 30, 45, 3]
        ds.prefetch(batch)
        faults.requests.clear()
        assert [ds.raw(i) for i in batch] == [local.raw(i) for i in batch]
        assert faults.requests == []  # every one of them read by the round before
        wrapped = SSLDataset(ds, lambda image: [image.float()])
        faults.fail = 1  # the round's first request fails: the round is read again
        samples = wrapped.__getitems__([(0, i) for i in batch])
        assert [s["index"] for s in samples] == batch and ds.remote.retried >= 1


def test_http_shards_read_sample_by_sample_as_the_local_ones(shards: Path, tmp_path: Path) -> None:
    with http_server(shards) as (base, faults):
        ds = ShardDataset(_pattern(base, shards), cache_dir=str(tmp_path / "cache"))
        _same_as_local(ds, shards)
        tar_gets = [r for r in faults.requests if r[0] == "GET" and r[1].endswith(".tar")]
        assert tar_gets and all(r[2].startswith("bytes=") for r in tar_gets)  # one ranged request a sample
        assert len(tar_gets) == len(ds) + 1  # each sample once, and the first once more when the dataset opened
        assert any(r[1].endswith(INDEX_SUFFIX) for r in faults.requests)  # the index beside each shard
    assert len(list((tmp_path / "cache" / "shard-index").glob("*.npz"))) == len(ds.shards)


def test_a_list_file_of_urls_names_the_remote_shards(shards: Path, tmp_path: Path) -> None:
    """A local text file listing shard URLs (one a line, comments and blank lines skipped) reads them as the brace
    pattern does."""
    with http_server(shards) as (base, _):
        names = sorted(p.name for p in shards.glob("*.tar"))
        listing = tmp_path / "shards.txt"
        listing.write_text("# the training shards\n" + "\n".join(f"{base}/{n}" for n in names) + "\n\n")
        ds = ShardDataset(str(listing), cache_dir=str(tmp_path / "cache"))
        assert ds.shards == [f"{base}/{n}" for n in names] and ds.remote is not None
        _same_as_local(ds, shards)


def test_without_index_files_the_headers_are_read_once_and_cached_by_the_shards_etag(shards: Path,
                                                                                       tmp_path: Path) -> None:
    served = tmp_path / "served"
    shutil.copytree(shards, served)
    for index in served.glob(f"*{INDEX_SUFFIX}"):
        index.unlink()
    cache = str(tmp_path / "cache")
    with http_server(served) as (base, faults):
        first = ShardDataset(_pattern(base, served), cache_dir=cache)
        _same_as_local(first, shards)
        faults.requests.clear()
        again = ShardDataset(_pattern(base, served), cache_dir=cache)  # from the local cache: a HEAD per shard
        np.testing.assert_array_equal(again.labels, first.labels)
        assert [r[0] for r in faults.requests if r[1].endswith(".tar")] == ["HEAD"] * len(first.shards) + ["GET"]
        tar = sorted(served.glob("*.tar"))[0]
        os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))  # a new ETag: indexed again
        faults.requests.clear()
        ShardDataset(_pattern(base, served), cache_dir=cache)
        assert sum(1 for r in faults.requests if r[0] == "GET" and r[1].endswith(tar.name)) >= 2


def test_a_flaky_network_is_retried_to_the_same_bytes_and_a_dead_one_is_named(shards: Path, tmp_path: Path) -> None:
    with http_server(shards) as (base, faults):
        ds = ShardDataset(_pattern(base, shards), cache_dir=str(tmp_path / "cache"))
        ds.remote.retries = QUICK
        local = ShardDataset(str(shards))
        faults.fail, faults.drop = 2, 1  # two 503 replies, then one reply cut off mid-body
        assert ds.raw(5) == local.raw(5)
        assert ds.remote.retried == 3 and faults.fail == faults.drop == 0
        faults.fail = 100
        with pytest.raises(RemoteReadError, match=r"sample \d+ of shard .* cannot be read \(.*failed 5 times.*The run "
                                                  r"stops here .* resumes from the last checkpoint"):
            ds.raw(6)  # not skipped as a corrupt image would be: the store is unreachable
        faults.fail = 0
        assert ds.raw(6) == local.raw(6)


def test_a_server_without_byte_ranges_and_a_missing_shard_stop_before_training(shards: Path, tmp_path: Path) -> None:
    with http_server(shards, ranges=False) as (base, _):
        with pytest.raises(DataSourceError, match="ignores byte ranges"):
            ShardDataset(_pattern(base, shards), cache_dir=str(tmp_path / "cache"))
    with http_server(shards) as (base, _):
        n = len(list(shards.glob("*.tar")))  # the first shard past the last one there is named
        with pytest.raises(DataSourceError, match=rf"shard http://.*/shard-{n:06d}.tar cannot be read: .*"
                                                  r"FileNotFoundError"):
            ShardDataset(f"{base}/shard-{{000000..000099}}.tar", cache_dir=str(tmp_path / "cache"))
        with pytest.raises(DataSourceError, match="an HTTP server cannot list a folder"):
            ShardDataset(f"{base}/", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"'data.train.path' = s3://bucket/x: a remote path is read by the "
                                          r"webdataset and hf sources .* not by folder"):
        compose_config(["data=folder", "data.train.path=s3://bucket/x"])


def test_s3_shards_from_moto_read_as_the_local_ones_and_list_by_prefix(shards: Path, tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    with s3_server() as options:
        _upload(options, shards, "s3://sslkit-test/train")
        ds = ShardDataset("s3://sslkit-test/train/", storage_options=options, cache_dir=str(tmp_path / "cache"))
        assert [str(s).rsplit("/", 1)[1] for s in ds.shards] == sorted(p.name for p in shards.glob("*.tar"))
        _same_as_local(ds, shards)
        braces = ShardDataset(_pattern("s3://sslkit-test/train", shards), storage_options=options,
                              cache_dir=str(tmp_path / "cache"))
        assert braces.shards == ds.shards
        with pytest.raises(DataSourceError, match=r"shard s3://sslkit-test/nothing.tar cannot be read"):
            ShardDataset("s3://sslkit-test/nothing.tar", storage_options=options, cache_dir=str(tmp_path / "c"))


def test_secrets_are_hidden_and_plain_options_kept() -> None:
    options = {"endpoint_url": "http://minio:9000", "key": "AKIA", "secret": "s3cr3t",
               "client_kwargs": {"region_name": "eu", "aws_session_token": "tok"}}
    kept = redact_config({"data": {"storage_options": options, "batch_size": 8}})
    assert kept == {"data": {"storage_options": {"endpoint_url": "http://minio:9000",
                                                 "client_kwargs": {"region_name": "eu"}}, "batch_size": 8}}
    assert redact_overrides(["config=simclr", "data.storage_options.secret=s3cr3t", "+data.storage_options={key: A}",
                             "data.storage_options.endpoint_url=http://m:9"]) == [
        "config=simclr", f"data.storage_options.secret={HIDDEN}", f"+data.storage_options={HIDDEN}",
        "data.storage_options.endpoint_url=http://m:9"]
    assert hidden_value("data.storage_options.key", "AKIA") == HIDDEN
    assert hidden_value("data.storage_options.anon", True) is True and hidden_value("data.limit", 3) == 3


@pytest.mark.slow
def test_a_run_on_s3_shards_trains_and_writes_no_credential(shards: Path, tmp_path: Path) -> None:
    """Through the CLI (one loader worker: the filesystem is made again in the worker), two steps on moto's S3 with
    the credentials in data.storage_options: nothing of the secret in the run folder, the log or the output."""
    pytest.importorskip("s3fs")
    with s3_server() as options:
        _upload(options, shards, "s3://sslkit-run")
        secret = "sEcReT-dO-nOt-WrItE-42"
        out = tmp_path / "run"
        proc = run_main(*SMALL_WDS, "data.train.path=s3://sslkit-run/", "data.batch_size=16", "data.num_workers=1",
                        "optim.max_steps=2", "eval.knn.enabled=false", "checkpoint.every_n_steps=1",
                        f"data.storage_options={{endpoint_url: '{options['endpoint_url']}', key: testing-key, "
                        f"secret: {secret}}}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}",
                        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert secret not in proc.stdout + proc.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and any("checkpoint" in str(p) for p in written)
    for path in written:
        assert secret.encode() not in path.read_bytes(), path
    assert options["endpoint_url"] in (out / "config.yaml").read_text()  # the plain options kept, for the tools


@pytest.mark.slow
def test_a_run_on_http_shards_killed_mid_epoch_resumes_bit_identically(shards: Path, tmp_path: Path) -> None:
    """As tests/data/test_shards.py's, the shards served over HTTP: 48 of the 49 samples in batches of 16 (3 steps an
    epoch, 4 epochs), a checkpoint every 4 steps, SIGKILL after step 10 (a process of its own, 2 loader workers
    reading by ranged requests): resumed from update 8, it ends bit-identical to an uninterrupted run."""
    from reliability_helpers import killed_at_10_resumes_identically

    with http_server(shards) as (base, _):
        args = [*SMALL_WDS, f"data.train.path='{_pattern(base, shards)}'", f"data.cache_dir={tmp_path / 'cache'}",
                "data.batch_size=16", "optim.epochs=4", "checkpoint.every_n_steps=4", "checkpoint.every_n_epochs=0",
                "checkpoint.keep_last=0",
                "eval.knn.enabled=false", "data.num_workers=2", "imports=[sslkit_faults]"]
        killed_at_10_resumes_identically(args, "simclr", tmp_path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_elastic_resume_from_s3_shards_reads_the_same_samples_at_every_step(tmp_path: Path) -> None:
    """As tests/data/test_shards.py's, the 4 shards in moto's S3: a 2-process run (global batch 32, 4 steps an epoch,
    2 epochs, read shard by shard) crashed after step 5 resumes on 1 and on 4 processes from its checkpoint of step 3,
    every later step reading the samples the uninterrupted run read."""
    pytest.importorskip("s3fs")
    from dist_workers import assert_resumed_as_uninterrupted, elastic_steps

    shards = four_shards(tmp_path)
    with s3_server() as options:
        _upload(options, shards, "s3://sslkit-elastic")
        storage = f"data.storage_options={{endpoint_url: '{options['endpoint_url']}', key: k, secret: s}}"
        args = [*SMALL_WDS, "data.train.path=s3://sslkit-elastic/", storage, f"data.cache_dir={tmp_path / 'cache'}",
                "data.order=shards", "data.shard_span=2", "data.global_batch_size=32", "optim.epochs=2",
                "checkpoint.every_n_steps=3", "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0",
                "eval.knn.enabled=false", "data.num_workers=0", "imports=[sslkit_faults]"]
        expected, resumed = elastic_steps(args, tmp_path)
    assert_resumed_as_uninterrupted(expected, resumed)


@pytest.mark.slow
def test_shards_gone_mid_run_stop_it_with_a_message_and_the_same_command_resumes(shards: Path,
                                                                                 tmp_path: Path) -> None:
    """The store loses the shards after step 3 (a checkpoint at step 2, one loader worker, whose error torch re-raises
    here with the worker's traceback in its text): the next read fails, the run stops with exit 2 and a message
    naming the shard and saying how to go on, no traceback, without training on other samples; with the shards back,
    the same command resumes from step 2 and ends as an uninterrupted run."""
    from reliability_helpers import assert_identical, latest_state

    from sslkit.hooks.base import SSLHook
    from sslkit.registry import HOOKS, register_hook

    served = tmp_path / "served"
    shutil.copytree(shards, served)
    hidden = tmp_path / "hidden"
    unplugged: list[int] = []  # once: the store comes back for the rerun

    class UnplugStore(SSLHook):
        name = "unplug_store_test"

        def __init__(self, step: int = 3) -> None:
            self.at = step

        def on_step(self, task) -> None:
            if task.clock.step == self.at and not unplugged:
                unplugged.append(self.at)
                served.rename(hidden)

    if "unplug_store_test" not in HOOKS:
        register_hook("unplug_store_test")(UnplugStore)
    with http_server(tmp_path) as (base, _):
        args = [*SMALL_WDS, f"data.train.path='{_pattern(base + '/served', shards)}'",
                f"data.cache_dir={tmp_path / 'cache'}", "data.read_attempts=2", "data.read_backoff_s=0.01",
                "data.batch_size=16", "optim.epochs=2", "checkpoint.every_n_steps=2", "checkpoint.every_n_epochs=0",
                "checkpoint.keep_last=0", "eval.knn.enabled=false", "data.num_workers=1"]
        ref = run_main(*args, "hooks=[{name: unplug_store_test, step: 1000000}]", f"output_dir={tmp_path / 'ref'}")
        assert ref.returncode == 0
        out = tmp_path / "run"
        proc = run_main(*args, "hooks=[{name: unplug_store_test}]", f"output_dir={out}", check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert re.search(r"sslkit: data error: sample \d+ of shard http://\S+/served/shard-\d+\.tar cannot be read .*"
                         r"FileNotFoundError.*the same command resumes from the last checkpoint \(in DataLoader "
                         r"worker process 0\)", proc.stderr), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert latest_state(out)["position"]["step"] == 2
        hidden.rename(served)
        again = run_main(*args, "hooks=[{name: unplug_store_test}]", f"output_dir={out}")
        assert "checkpoint_000000002.pt" in again.stdout + again.stderr
    assert_identical(latest_state(out), latest_state(tmp_path / "ref"))


def test_pack_uploads_to_s3_and_index_writes_the_missing_indexes(shards: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``sslkit data pack output=s3://...`` uploads each shard with its index (credentials and endpoint from the
    environment, as s3fs takes them) and leaves nothing staged; the shards read back as the local pack; ``sslkit
    data index`` writes the index beside shards that have none, which the next reader fetches instead of the
    headers."""
    pytest.importorskip("s3fs")
    from helpers import photo_folder, run_sslkit

    photo_folder(tmp_path / "images", n=48)
    with s3_server() as options:
        for var, value in (("AWS_ENDPOINT_URL", options["endpoint_url"]), ("AWS_ACCESS_KEY_ID", options["key"]),
                           ("AWS_SECRET_ACCESS_KEY", options["secret"])):
            monkeypatch.setenv(var, value)
        monkeypatch.setenv("SSLKIT_CACHE", str(tmp_path / "cache"))
        store = Remote("s3", {})
        store.fs.mkdir("sslkit-pack")
        code, out, err = run_sslkit("data", "pack", f"input={tmp_path / 'images'}", "output=s3://sslkit-pack/train/",
                                    "shard_mb=0.04")
        assert code == 0, err
        assert re.search(r"packed 49 images \(2 classes\) .* into \d+ shard\(s\) at s3://sslkit-pack/train/", out)
        assert not any((tmp_path / "cache").glob("pack-*/*"))  # nothing left staged here
        names = sorted(p.rsplit("/", 1)[1] for p in store.glob("s3://sslkit-pack/train/*"))
        assert names == sorted(p.name for p in shards.iterdir())  # each shard and its index, as the local pack
        ds = ShardDataset("s3://sslkit-pack/train/", cache_dir=str(tmp_path / "c1"))
        _same_as_local(ds, shards)
        code, _, err = run_sslkit("data", "pack", f"input={tmp_path / 'images'}", "output=s3://sslkit-pack/train/")
        assert code == 2 and "holds shards already" in err
        for f in sorted(shards.glob("*.tar")):  # shards without an index beside them
            store.put(f, f"s3://sslkit-pack/bare/{f.name}")
        code, out, err = run_sslkit("data", "index", "path=s3://sslkit-pack/bare/")
        assert code == 0 and re.search(r"indexed \d+ shard\(s\) of s3://sslkit-pack/bare/", out), err
        assert len(store.glob(f"s3://sslkit-pack/bare/*{INDEX_SUFFIX}")) == len(list(shards.glob("*.tar")))
        _same_as_local(ShardDataset("s3://sslkit-pack/bare/", cache_dir=str(tmp_path / "c2")), shards)


def _wait_for(condition, what: str) -> None:
    """Wait for ``condition()`` (a background fetch's outcome) under the suite's hang guard."""
    import time

    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"hung waiting for {what}"
        time.sleep(0.01)


def test_whole_shards_are_fetched_in_the_background_once_then_read_locally_and_evicted_past_the_limit(
        shards: Path, tmp_path: Path) -> None:
    """data.cache_gb: the first read of a shard's sample comes by range and starts the shard's fetch; once it is
    there the shard's samples are read from disk (no request), the same bytes; past the limit the least recently
    read copy goes; a second process (a loader worker) reuses the copies and fetches nothing the first fetched."""
    import multiprocessing

    files = sorted(shards.glob("*.tar"))
    limit_gb = (files[0].stat().st_size + files[1].stat().st_size + 100) / (1 << 30)  # two shards fit, not three
    cache = tmp_path / "cache"
    with http_server(shards) as (base, faults):
        ds = ShardDataset(_pattern(base, shards), cache_dir=str(cache), cache_gb=limit_gb)
        local = ShardDataset(str(shards))
        copies = cache / "shards"
        first = range(int(ds.starts[0]), int(ds.starts[1]))
        assert ds.raw(first[0]) == local.raw(first[0])  # by range; the fetch starts
        _wait_for(lambda: len(list(copies.glob("*.tar"))) == 1, "the first shard's copy")
        faults.requests.clear()
        assert all(ds.raw(i) == local.raw(i) for i in first)
        assert faults.requests == []  # every sample of the shard from its local copy
        for shard in (1, 2):
            ds.raw(int(ds.starts[shard]))
            _wait_for(lambda n=shard: ds.shard_cache.fetched == n + 1, f"shard {shard}'s copy")
        assert sorted(p.name for p in copies.glob("*.tar")) == sorted(f"{k}.tar" for k in ds.copy_keys[1:])
        assert not list(copies.glob("*.part"))  # the oldest copy went; nothing half-written left

        def worker(queue: multiprocessing.Queue) -> None:  # a forked loader worker: the copies are there
            queue.put([ds.raw(int(ds.starts[s])) == local.raw(int(ds.starts[s])) for s in (1, 2)])

        faults.requests.clear()
        queue: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()
        proc = multiprocessing.get_context("fork").Process(target=worker, args=(queue,))
        proc.start()
        assert queue.get(timeout=HANG_S) == [True, True]
        proc.join(HANG_S)
        assert faults.requests == []


def _parquet_dataset(root: Path, n: int = 60) -> Path:
    """n JPEG rows (labels in 4 named classes) as a Hugging Face dataset's Parquet files: 2 files of row groups of
    8 rows."""
    import io

    datasets = pytest.importorskip("datasets")
    from PIL import Image

    def jpeg(i: int) -> bytes:
        buf = io.BytesIO()
        pixels = (np.random.default_rng(i).random((30 + i % 7, 26, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        return buf.getvalue()

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list("abcd"))})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": jpeg(i), "path": None} for i in range(n)],
                                     "label": [i % 4 for i in range(n)]}, features=features)
    root.mkdir(parents=True)
    half = n // 2
    for k, part in enumerate((ds.select(range(half)), ds.select(range(half, n)))):
        part.to_parquet(str(root / f"train-{k:05d}-of-00002.parquet"), batch_size=8)
    return root


def test_hugging_face_parquet_in_s3_is_read_row_by_row_as_the_local_files(tmp_path: Path) -> None:
    """data=hf with an s3:// prefix: every row's image and label as the local Parquet files give them, the class
    names from the dataset's metadata; row groups read by range and kept, or, with data.cache_gb, the whole file
    fetched in the background and read from disk after."""
    pytest.importorskip("s3fs")
    import torch

    from sslkit.data.hf import HFDataset, build_hf

    local = HFDataset(_parquet_dataset(tmp_path / "ds"), label_column="label")
    with s3_server() as options:
        store = Remote("s3", options)
        store.fs.mkdir("sslkit-hf")
        for f in sorted((tmp_path / "ds").iterdir()):
            store.put(f, f"s3://sslkit-hf/ds/data/{f.name}")
        ds = build_hf("train", "s3://sslkit-hf/ds/", label_column="label", storage_options=options,
                      cache_dir=str(tmp_path / "cache"))
        assert len(ds) == len(local) == 60 and ds.classes == list("abcd") and ds.num_classes == 4
        np.testing.assert_array_equal(ds.labels, local.labels)
        for i in range(len(local)):
            image, label = ds[i]
            torch.testing.assert_close(image, local[i][0], rtol=0, atol=0)
            assert label == local[i][1]
        cached = build_hf("train", "s3://sslkit-hf/ds/", label_column="label", storage_options=options,
                          cache_dir=str(tmp_path / "cache"), cache_gb=1.0)
        cached[0]  # by range; the first file's fetch starts
        _wait_for(lambda: cached.cache.fetched == 1, "the first file's copy")
        cached._kept.clear()
        torch.testing.assert_close(cached[9][0], local[9][0], rtol=0, atol=0)  # from the local copy
        with pytest.raises(DataSourceError, match="has no column 'pixels'"):
            build_hf("train", "s3://sslkit-hf/ds/", image_column="pixels", storage_options=options,
                     cache_dir=str(tmp_path / "other"))


def test_the_next_window_of_shards_is_fetched_while_this_one_is_read(shards: Path, tmp_path: Path) -> None:
    """data.order=shards with whole shards cached: a batch of the epoch's first window (the sampler's own order,
    shard_windows) starts the fetch of the second window's shard, not of the third's."""
    from sslkit.data.sampler import grouped_order, shard_windows

    with http_server(shards) as (base, _):
        ds = ShardDataset(_pattern(base, shards), cache_dir=str(tmp_path / "cache"), cache_gb=1.0)
        ds.plan_windows(seed=7, span=1)
        windows = shard_windows(len(ds.shards), 1, 7 + 3)  # epoch 3
        order = grouped_order(len(ds), [int(s) for s in ds.starts[:-1]], 1, 7 + 3)
        assert [ds.locate(int(i))[0] for i in order[:4]] == [windows[0][0]] * 4  # the sampler reads that window first
        ds.prefetch([int(i) for i in order[:4]], epoch=3)
        nxt, later = windows[1][0], windows[2][0]
        _wait_for(lambda: (ds.shard_cache.root / f"{ds.copy_keys[windows[0][0]]}.tar").is_file(),
                  "the batch's own shard, whose fetch its round of ranged reads started")
        _wait_for(lambda: (ds.shard_cache.root / f"{ds.copy_keys[nxt]}.tar").is_file(), "the next window's shard")
        assert not (ds.shard_cache.root / f"{ds.copy_keys[later]}.tar").exists()


@pytest.mark.slow
def test_a_run_on_remote_parquet_killed_mid_epoch_resumes_bit_identically(tmp_path: Path) -> None:
    """data=hf on a Hugging Face dataset's Parquet files served over HTTP (a brace pattern): 60 rows in batches of 16
    (3 steps an epoch, 4 epochs), a checkpoint every 4 steps, SIGKILL after step 10 (2 loader workers): resumed from
    update 8, it ends bit-identical to an uninterrupted run."""
    from reliability_helpers import killed_at_10_resumes_identically

    root = _parquet_dataset(tmp_path / "ds")
    with http_server(root) as (base, _):
        hf = [a.replace("data=webdataset", "data=hf") for a in SMALL_WDS]
        args = [*hf, f"data.train.path='{base}/train-{{00000..00001}}-of-00002.parquet'",
                "data.train.kwargs.label_column=label", f"data.cache_dir={tmp_path / 'cache'}", "data.batch_size=16",
                "optim.epochs=4", "checkpoint.every_n_steps=4", "checkpoint.every_n_epochs=0",
                "checkpoint.keep_last=0", "eval.knn.enabled=false", "data.num_workers=2", "imports=[sslkit_faults]"]
        killed_at_10_resumes_identically(args, "simclr", tmp_path)
