"""Images of many sizes and JPEGs decoded on the device: each image cropped within its own size, bytes decoded in
one batch, undecodable files replaced and counted, and runs on a folder of photos with data.augment_on=device."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from helpers import photo
from PIL import Image

import sslkit.data.device_augment as device_augment
from sslkit.data.device_augment import PackedImages, crop_and_resize, crop_boxes
from sslkit.data.device_decode import DeviceDecoder, RawImages, collate_raw
from sslkit.data.transforms import random_resized_crop_box

SIZES = [(28, 40), (40, 12), (375, 500), (17, 17), (64, 33), (12, 90)]


def _images(channels: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (channels, h, w), generator=g, dtype=torch.uint8) for h, w in SIZES]


def test_crop_boxes_with_a_size_per_image_equal_the_per_image_boxes() -> None:
    """One size per row (tall, wide, square, one where no attempt fits): each box is the per-image transform's."""
    rows = 600
    u = torch.rand(rows, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    heights = torch.tensor([SIZES[i % len(SIZES)][0] for i in range(rows)])
    widths = torch.tensor([SIZES[i % len(SIZES)][1] for i in range(rows)])
    got = crop_boxes(u, heights, widths, (0.5, 1.0), (2.0, 3.0)).tolist()
    expected = [list(random_resized_crop_box(row, int(h), int(w), (0.5, 1.0), (2.0, 3.0)))
                for row, h, w in zip(u.tolist(), heights, widths, strict=True)]
    assert got == expected
    assert any(box[2] == h and box[3] < w for box, h, w in zip(got, heights.tolist(), widths.tolist(), strict=True))


@pytest.mark.parametrize("budget", [1 << 25, 5_000])
def test_a_batch_of_many_sizes_crops_each_image_as_if_alone(monkeypatch, budget: int) -> None:
    """Packed, padded (by repeating the edge) and resized in chunks (one chunk, or many under a small budget),
    every crop equals that image's crop on its own, edges included (boxes reach the borders)."""
    monkeypatch.setattr(device_augment, "_CHUNK_ELEMENTS", budget)
    images = _images()
    u = torch.rand(len(images), 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    u[:, 2:40:4] = 0.999999  # the last top and left positions: boxes touch the bottom and right edges
    u[:, 3:40:4] = 0.999999
    packed = PackedImages.of(images)
    if budget < 1 << 20:
        assert len(packed.chunks(budget)) > 1
    got = crop_and_resize(packed, u, 24, (0.2, 1.0), (3 / 4, 4 / 3))
    alone = torch.cat([crop_and_resize(img[None], u[i : i + 1], 24, (0.2, 1.0), (3 / 4, 4 / 3))
                       for i, img in enumerate(images)])
    assert got.shape == (len(images), 3, 24, 24)
    torch.testing.assert_close(got, alone, rtol=0, atol=2e-6)


def test_images_of_one_size_are_one_stacked_batch() -> None:
    images = [torch.full((3, 8, 8), i, dtype=torch.uint8) for i in range(4)]
    stacked = collate_raw(images)
    assert isinstance(stacked, torch.Tensor) and stacked.shape == (4, 3, 8, 8)
    packed = PackedImages.of(images).stacked()
    assert packed is not None and torch.equal(packed, stacked)


def _jpeg(image: Image.Image, quality: int = 95) -> torch.Tensor:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def test_decoder_decodes_jpegs_and_packs_decoded_images_in_batch_order(caplog) -> None:
    """JPEG bytes and worker-decoded images mixed in a batch: the decoded batch keeps their order, the JPEGs are
    PIL's pixels (up to the decoders' rounding), a CMYK JPEG is decoded too, and a corrupt file is replaced by
    another image of the batch, marked invalid and named once in a warning."""
    photos = [photo(30 + 7 * i, 40 - 3 * i, i) for i in range(4)]
    decoded = torch.from_numpy(np.array(photo(20, 24, 9))).permute(2, 0, 1).contiguous()
    cmyk = _jpeg(photos[3].convert("CMYK"))
    items = [_jpeg(photos[0]), decoded, _jpeg(photos[1]), torch.tensor([0xFF, 0xD8, 0xFF, 1, 2, 3], dtype=torch.uint8),
             _jpeg(photos[2]), cmyk]
    raw = collate_raw(items)
    assert isinstance(raw, RawImages) and raw.decoded_at == [1] and raw.encoded_at == [0, 2, 3, 4, 5]
    sample = {"data_valid": torch.ones(6, dtype=torch.bool), "data_idx": torch.arange(10, 16)}
    decoder = DeviceDecoder(3, describe=lambda i: f"file-{i}.jpg")
    with caplog.at_level("WARNING", logger="sslkit.data"):
        packed = decoder(raw, sample, torch.device("cpu"))
        decoder(raw, {"data_valid": torch.ones(6, dtype=torch.bool), "data_idx": torch.arange(10, 16)},
                torch.device("cpu"))
    assert sample["data_valid"].tolist() == [True, True, True, False, True, True]
    assert [r.getMessage() for r in caplog.records if "file-13.jpg" in r.getMessage()].__len__() == 1
    assert packed.shapes[1] == (3, 20, 24) and packed.shapes[3] == packed.shapes[0]  # replaced by the first image
    out = [packed.flat[int(s): int(s) + math.prod(shape)].view(shape) for s, shape in
           zip(packed.start, packed.shapes, strict=True)]
    assert torch.equal(out[1], decoded)
    for at in (0, 2, 4):
        pil = torch.from_numpy(np.array(Image.open(io.BytesIO(bytes(items[at].tolist())))))
        assert out[at].shape == pil.permute(2, 0, 1).shape
        assert (out[at].float() - pil.permute(2, 0, 1).float()).abs().mean() < 1.0
    assert out[5].shape == (3, photos[3].height, photos[3].width)
    assert (out[5].float() - torch.from_numpy(np.array(photos[3])).permute(2, 0, 1)).abs().mean() < 4


def test_a_batch_with_no_decodable_image_says_so() -> None:
    from sslkit.data.sources import DataSourceError

    raw = collate_raw([torch.tensor([0xFF, 0xD8, 0xFF, v], dtype=torch.uint8) for v in (0, 7)])
    with pytest.raises(DataSourceError, match="no image of a batch of 2 could be decoded"):
        DeviceDecoder(3)(raw, {"data_idx": torch.tensor([0, 1])}, torch.device("cpu"))


# ------------------------------------------------------------------------------ runs on a folder of photos
@pytest.mark.parametrize("decode_on", ["workers", "device"])
def test_a_folder_of_many_sizes_trains_with_the_augmentation_on_the_device(tmp_path, decode_on: str) -> None:
    """data=folder with data.augment_on=device: images of many sizes, PNGs decoded in the workers, JPEGs in the
    workers or (decode_on=device) in one batched call in the training process; the corrupt JPEG is skipped
    and counted either way."""
    from helpers import metrics, photo_folder, run_main

    photo_folder(tmp_path / "images")
    proc = run_main("config=simclr", "data=folder", f"data.train.path={tmp_path / 'images'}", "machine.device=cpu",
                    "data.num_workers=0", "model.trunk=small_cnn", "model.trunk_kwargs={width: 8}",
                    "data.image_size=16", "data.small_image_size=8", "data.batch_size=8", "optim.max_steps=3",
                    "eval.knn.enabled=false", "log.tensorboard=false", "log.every_n_steps=1",
                    "data.augment_on=device", f"data.decode_on={decode_on}", f"output_dir={tmp_path / 'run'}",
                    check=False)
    assert proc.returncode == 0, proc.stderr
    assert ("decoded on the training device" in proc.stdout) == (decode_on == "device")
    records = metrics(tmp_path / "run")
    losses = [r["loss"] for r in records if r.get("phase") == "train" and "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert "broken.jpg" in proc.stdout + proc.stderr
    assert sum(r.get("unreadable_samples", 0) for r in records) == 1


def test_decode_on_device_without_the_augmentation_there_is_a_config_error(tmp_path) -> None:
    from helpers import SMALL, run_main

    proc = run_main(*SMALL, "config=simclr", "data.augment_on=workers", "data.decode_on=device",
                    f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 2 and "data.augment_on=device" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
