"""On CUDA: 4-channel 16-bit images trained with the augmentation on the device and on the workers, the reference
sets' kNN on the GPU (never run on a GPU when written)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL, four_channel_folder, pixels, run_main

from sslkit.data.device_augment import DeviceSimCLRAugment
from sslkit.data.transforms import SimCLRTransform, unit_float

pytestmark = [pytest.mark.gpu]

GPU = ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16"]
FOLDER = ["data=folder", *(o for o in SMALL if not o.startswith(("data=", "data.train.kwargs.", "machine.device"))),
          "model.trunk=small_cnn", "data.image_size=32", "data.patch_size=8", "data.train.kwargs.channels=4",
          "data.test.kwargs.channels=4", "data.batch_size=8", "log.tensorboard=false"]


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("per_channel", [False, True])
def test_16_bit_views_on_cuda_equal_the_cpus(per_channel: bool) -> None:
    """The device augmentation of a 16-bit 4-channel batch (the workers hand it over as float in 0..1) on CUDA and on
    the CPU from the same uniforms: the same views to float rounding (brightness and contrast per channel too)."""
    _needs_cuda()
    images = unit_float(torch.from_numpy(pixels((6, 4, 32, 32), np.uint16, 0)))
    spec = SimCLRTransform(24, mean=[0.5] * 4, std=[0.25] * 4, jitter_per_channel=per_channel)
    aug = DeviceSimCLRAugment.from_transform(spec)
    u = torch.rand(6, spec.uniforms(4), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(aug.views(images.cuda(), u.cuda()).cpu(), aug.views(images, u), rtol=0, atol=1e-4)


@pytest.mark.parametrize("augment_on", ["device", "workers"])
def test_a_four_channel_16_bit_folder_trains_on_cuda_with_reference_sets(tmp_path: Path, augment_on: str) -> None:
    _needs_cuda()
    data = tmp_path / "data"
    four_channel_folder(data)
    out = tmp_path / "run"
    run_main("config=simclr", *FOLDER, *GPU, f"data.train.path={data}", f"data.test.path={data}", "optim.max_steps=4",
             f"data.augment_on={augment_on}", "eval.reference.sets=[{name: a, split: train}]",
             "eval.reference.every_n_steps=2", "eval.reference.k=3", f"output_dir={out}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "ref_a_knn_top1" in r] == [0, 2, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
