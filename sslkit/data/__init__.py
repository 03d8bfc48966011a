"""Data: sources, augmentations, the seeded dataset wrapper, the resumable sampler and the loader."""

# (hf, shards and wild_files register their sources)
from sslkit.data import health, hf, shards, sources, transforms, wild_files  # noqa: F401
from sslkit.data.dataset import SSLDataset
from sslkit.data.health import SkippedSamples, SkipTotals
from sslkit.data.loader import build_loader, collate_views
from sslkit.data.sampler import StatefulDistributedSampler
from sslkit.data.seeding import mix_seed
from sslkit.data.sources import (
    DataSourceError,
    FileListDataset,
    FolderDataset,
    SyntheticDataset,
    TensorImageDataset,
    UnreadableSampleError,
    build_source,
)
from sslkit.data.transforms import EvalTransform, SimCLRTransform, build_transform

__all__ = [
    "DataSourceError",
    "EvalTransform",
    "FileListDataset",
    "FolderDataset",
    "SSLDataset",
    "SimCLRTransform",
    "SkipTotals",
    "SkippedSamples",
    "StatefulDistributedSampler",
    "SyntheticDataset",
    "TensorImageDataset",
    "UnreadableSampleError",
    "build_loader",
    "build_source",
    "build_transform",
    "collate_views",
    "health",
    "mix_seed",
    "sources",
    "transforms",
]
