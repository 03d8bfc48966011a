"""What this machine has, as a config needs it: its GPUs, the host names it resolves, the files and folders a config
names. The last layer of validation (:mod:`sslkit.config.validate`): probes, no rules between keys."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

__all__ = ["check_device", "check_hosts", "check_paths"]


#: Sources that read a remote ``data.<split>.path`` (``s3://``, ``gs://``, ``https://``).
_REMOTE_SOURCES = ("webdataset", "hf")

#: Sources that read ``data.<split>.path`` as a folder, and what to give there.
_PATH_SOURCES = {
    "folder": "the folder source needs the folder holding the images",
    "fashion_mnist": "give the folder of the Fashion-MNIST idx files, or leave it unset (null) for the system copy",
}


def check_paths(cfg: DictConfig, errors: list[str]) -> None:
    """Sources that read a folder (``folder``, ``fashion_mnist``): a ``data.<split>.path`` that is set must be an
    existing folder (so a typo stops here, before the output folder is made, and never falls back to another
    copy), and for the ``folder`` source one that holds an image file; the ``folder`` source needs the train path.
    The ``filelist`` source likewise, with a file; the ``hf`` source, with a folder or file that exists."""
    from sslkit.data.remote import is_url

    for split in ("train", "test"):
        source = cfg.data[split].source or cfg.data.train.source
        path = cfg.data[split].path
        if is_url(path):
            if source not in _REMOTE_SOURCES:
                errors.append(f"'data.{split}.path' = {path}: a remote path is read by the "
                              f"{' and '.join(_REMOTE_SOURCES)} sources (data=webdataset: tar shards; data=hf: Parquet "
                              f"files), not by {source}: pack the images into tar shards (sslkit data pack "
                              "output=s3://...), or copy them to local disk")
            continue  # its shards are looked up when the source is opened, before training, each named if missing
        if source == "filelist":
            if path is None and split == "train":
                errors.append("'data.train.path' must be set for the filelist source: the file listing the images "
                              "(lines 'path' or 'path,label'), e.g. data.train.path=/data/train.csv")
            elif path is not None and not Path(str(path)).expanduser().is_file():
                what = ("is a folder, not a file (data=folder reads a folder of images)"
                        if Path(str(path)).expanduser().exists() else "does not exist")
                errors.append(f"'data.{split}.path' = {path}: {what}; the filelist source needs the file listing "
                              "the images, one 'path' or 'path,label' a line")
            continue
        if source == "webdataset":
            _check_shard_paths(split, path, errors)
            continue
        if source == "hf":
            if path is None and split == "train":
                errors.append("'data.train.path' must be set for the hf source: a folder written by datasets' "
                              "save_to_disk, or Parquet / Arrow files, e.g. data.train.path=/data/my_dataset")
            elif path is not None and not Path(str(path)).expanduser().exists():
                errors.append(f"'data.{split}.path' = {path}: does not exist; the hf source reads a folder written "
                              "by datasets' save_to_disk, or Parquet / Arrow files")
            continue
        if source not in _PATH_SOURCES:
            continue
        if path is None:
            if source == "folder" and split == "train":
                errors.append("'data.train.path' must be set for the folder source: the folder of images "
                              "(an ImageFolder tree or a flat folder), e.g. data.train.path=/data/train")
            continue
        folder = Path(str(path)).expanduser()
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            errors.append(f"'data.{split}.path' = {path}: {what}; {_PATH_SOURCES[source]}")
        elif source == "folder":
            from sslkit.data.sources import IMAGE_EXTENSIONS, holds_images

            if holds_images(folder) is False:
                errors.append(f"'data.{split}.path' = {path}: no image files in the folder or below it (extensions "
                              f"{', '.join(IMAGE_EXTENSIONS)}, any case); {_PATH_SOURCES[source]}")


def _check_shard_paths(split: str, path: Any, errors: list[str]) -> None:
    """``data=webdataset``: a train path, and shards that are all there (the first missing ones named)."""
    if path is None:
        if split == "train":
            errors.append("'data.train.path' must be set for the webdataset source: a folder of .tar shards, a brace "
                          "pattern (/data/train-{000000..000099}.tar) or a list file")
        return
    from sslkit.data.shards import expand_shards
    from sslkit.data.sources import DataSourceError

    try:
        shards = expand_shards(str(path))
    except DataSourceError as exc:
        errors.append(f"'data.{split}.path' = {path}: {exc}")
        return
    missing = [str(s) for s in shards if not s.is_file()]
    if not shards:
        errors.append(f"'data.{split}.path' = {path}: names no .tar shard (an empty folder or list)")
    elif missing:
        errors.append(f"'data.{split}.path' = {path}: {len(missing)} of its {len(shards)} shard(s) do not exist "
                      f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): check the pattern, or leave "
                      "them out")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _why_no_cuda() -> str:
    """Why ``torch.cuda.is_available()`` is False, in words a user can act on."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch to use a GPU."
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no usable GPU{where}: "
            "check that a GPU and its driver are there (nvidia-smi).")


def check_device(cfg: DictConfig, errors: list[str]) -> None:
    """``machine.device`` must name a device this machine has, and a run on GPUs needs one GPU per process
    (NCCL refuses two ranks on one GPU): checked here, before anything is written."""
    from sslkit.distributed import launched_by_torchrun

    device, d = str(cfg.machine.device), cfg.distributed
    torchrun = launched_by_torchrun()
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) if torchrun else d.nproc_per_node
    how = "torchrun --nproc_per_node" if torchrun else "distributed.nproc_per_node"
    if device == "cpu" or (device == "auto" and not _cuda_available()):
        if d.backend == "nccl":
            why = "" if device == "cpu" else ", and no GPU is visible"
            errors.append(f"'distributed.backend' = nccl needs GPUs, but the processes run on the CPU (machine.device="
                          f"{device}{why}). Use distributed.backend=gloo or auto.")
        return
    if not _cuda_available():
        errors.append(f"'machine.device' = {device}: {_why_no_cuda()} Or set machine.device=cpu (auto picks the GPU "
                      "when there is one).")
        return
    count = _cuda_device_count()
    if device.startswith("cuda:"):
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= count:
            errors.append(f"'machine.device' = {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}.")
        elif procs > 1:
            errors.append(f"'machine.device' = {device} names one GPU, but {procs} processes each need their own "
                          f"({how}={procs}): set machine.device=cuda, and process i uses cuda:i.")
    if procs > count:
        errors.append(f"'{how}' = {procs}: {procs} processes on GPUs need {procs} GPUs, and {count} is visible "
                      f"(one process per GPU; NCCL refuses two ranks on one GPU). Set {how}={count}, or "
                      f"machine.device=cpu to run {procs} CPU processes with gloo.")



def check_hosts(cfg: DictConfig, errors: list[str]) -> None:
    """A run over several nodes started by sslkit (not torchrun): ``distributed.master_addr`` resolves here."""
    from sslkit.distributed import launched_by_torchrun

    d = cfg.distributed
    if d.num_nodes > 1 and not launched_by_torchrun():
        try:
            socket.getaddrinfo(str(d.master_addr), None)
        except (OSError, UnicodeError):
            errors.append(f"'distributed.master_addr' = {d.master_addr}: no such host (it does not resolve here), so "
                          "the processes could never meet. Set it to the address of node 0.")
