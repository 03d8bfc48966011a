"""The dataset wrapper that applies seeded augmentation and skips unreadable samples."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from sslkit.data.seeding import mix_seed
from sslkit.data.sources import DataSourceError, UnreadableSampleError

__all__ = ["SSLDataset", "sample_file"]

logger = logging.getLogger("sslkit.data")


def sample_file(source: Dataset, index: int) -> str | None:
    """The file sample ``index`` of ``source`` is read from (through any subsets of it), or None for a source
    without files."""
    i = index
    while isinstance(source, Subset):
        source, i = source.dataset, source.indices[i]
    samples = getattr(source, "samples", None)
    return str(samples[i][0]) if samples else None


class SSLDataset(Dataset):
    """Wrap a source of ``(uint8 image, label)`` and a transform into training samples.

    ``dataset[(epoch, index)]`` returns ``{"views", "label", "index", "valid"}``. The
    augmentation is seeded from ``(seed, epoch, index)`` alone, so a sample's views do not depend
    on the number of workers, the batch it lands in, or a resume; torch's global CPU RNG is
    restored afterwards. An unreadable source sample is replaced by the next readable one
    (``valid`` False, so the batch's ``data_valid`` marks it and
    :class:`~sslkit.data.health.SkippedSamples` counts it in the main process), with one warning
    per bad file; if no sample at all can be read, :class:`DataSourceError` is raised.
    """

    def __init__(self, source: Dataset, transform: Callable[[torch.Tensor], list[torch.Tensor]], seed: int = 0):
        """Wrap ``source`` and ``transform``; ``seed`` picks the augmentation stream."""
        self.source = source
        self.transform = transform
        self.seed = int(seed)
        self._bad: set[int] = set()  # indices found unreadable (per process)
        self._warned: set[str] = set()
        self._first_error = ""

    def __getitems__(self, keys: list[Any]) -> list[dict[str, Any]]:
        """A batch's samples (what the loader asks for at once): a source that reads faster many at a time (remote
        shards: concurrent ranged reads, :meth:`~sslkit.data.shards.ShardDataset.prefetch`) is told the batch's
        indices first; then each sample as :meth:`__getitem__` makes it."""
        source, indices = self.source, [int(k[1]) if isinstance(k, tuple | list) else int(k) for k in keys]
        epoch = int(keys[0][0]) if keys and isinstance(keys[0], tuple | list) else 0
        while isinstance(source, Subset):
            source, indices = source.dataset, [int(source.indices[i]) for i in indices]
        prefetch = getattr(source, "prefetch", None)
        if callable(prefetch):
            prefetch(indices, epoch=epoch)
        return [self[k] for k in keys]

    def __len__(self) -> int:
        """Length of the source."""
        return len(self.source)  # type: ignore[arg-type]

    @property
    def num_classes(self) -> int:
        """The source's number of classes (0 if unknown)."""
        return int(getattr(self.source, "num_classes", 0))

    @property
    def channels(self) -> int:
        """The source's number of image channels."""
        return int(getattr(self.source, "channels", 3))

    def describe(self, index: int) -> str:
        """Sample ``index`` named for a message: its file where the source has files."""
        return sample_file(self.source, index) or f"sample {index}"

    def _warn_once(self, err: UnreadableSampleError) -> None:
        key = err.path or str(err)
        if key not in self._warned:
            self._first_error = self._first_error or str(err)
            self._warned.add(key)
            logger.warning("skipping unreadable sample (%s); using the next readable one instead", err)

    def _read(self, index: int) -> tuple[torch.Tensor, int, bool]:
        """Source sample ``index``, or the next readable one (wrapping) with valid False."""
        n = len(self)
        for k in range(n):
            i = (index + k) % n
            if i in self._bad:
                continue
            try:
                image, label = self.source[i]
            except UnreadableSampleError as e:
                self._bad.add(i)
                self._warn_once(e)
                continue
            return image, int(label), k == 0
        where = getattr(self.source, "root", None)
        raise DataSourceError(
            f"no readable image in {n} files{f' under {where}' if where else ''}: every sample is corrupt, "
            f"truncated or not an image (e.g. {self._first_error or 'see the warnings above'})"
        )

    def __getitem__(self, key: tuple[int, ...] | int) -> dict[str, Any]:
        """The sample for ``(epoch, index)`` (a plain int means epoch 0). A third entry, the update the sample's
        batch trains (:meth:`~sslkit.data.sampler.StatefulDistributedSampler.updates_from`), picks the transform
        of that update when the transform changes with it (:class:`~sslkit.data.resolution.PhasedTransform`)."""
        if isinstance(key, (tuple, list)):
            epoch, index = int(key[0]), int(key[1])
            update = int(key[2]) if len(key) > 2 else None
        else:
            epoch, index, update = 0, int(key), None
        n = len(self)
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        image, label, valid = self._read(index)
        transform = self.transform
        if update is not None and hasattr(transform, "at"):
            transform = transform.at(update)
        state = torch.get_rng_state()
        try:
            torch.default_generator.manual_seed(mix_seed(self.seed, epoch, index))
            made = transform(image)
        finally:
            torch.set_rng_state(state)
        sample: dict[str, Any] = {"label": label, "index": index, "valid": valid}
        if isinstance(made, dict):  # views and the views only a teacher sees (MultiCropTransform's teacher_size)
            sample.update(made)
        else:
            sample["views"] = made
        return sample
