"""MoCo v3 on two gloo ranks (keys gathered across ranks) gives the loss and gradients of one process."""

from __future__ import annotations

import pytest
import torch
from dist_workers import mocov3_loss_and_grads, run_ranks

pytestmark = pytest.mark.multiprocess


def test_mocov3_two_ranks_batch_b_equal_one_process_batch_2b(tmp_path) -> None:
    # Each rank contrasts its B queries with the 2B keys of both ranks (label: own key at rank * B + i),
    # so the mean over ranks of the per-rank losses, and DDP's mean of the gradients, are those of one
    # process on 2B samples. Without the gather each rank would see only B keys and both would differ.
    n = 12
    ref = mocov3_loss_and_grads(0, 1, n)
    assert all(g.abs().sum() > 0 for g in ref["grads"])  # trunk, projector and predictor all get gradient
    results = run_ranks(mocov3_loss_and_grads, 2, str(tmp_path / "out"), n)
    for res in results:
        assert torch.allclose(res["loss"], ref["loss"], atol=1e-6), (res["loss"], ref["loss"])
        assert torch.allclose(res["acc"], ref["acc"], atol=1e-6)
        assert len(res["grads"]) == len(ref["grads"])
        for g, g_ref in zip(res["grads"], ref["grads"]):
            assert torch.allclose(g, g_ref, atol=1e-6), (g - g_ref).abs().max()
