"""SmallCNN's grid pooling equals adaptive average pooling and has a deterministic backward on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sslkit.launch.audit import StepAudit
from sslkit.models.trunks import SmallCNN, grid_pool


@pytest.mark.parametrize(("h", "w"), [(4, 4), (8, 8), (12, 12), (2, 2), (7, 7), (3, 5), (9, 6)])
def test_grid_pool_is_adaptive_average_pooling(h: int, w: int) -> None:
    x = torch.randn(2, 3, h, w, dtype=torch.float64, requires_grad=True)
    ours, ref = grid_pool(x, 4), F.adaptive_avg_pool2d(x, 4)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(ref)
    (g_ours,), (g_ref,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(ref, x, g)
    assert torch.allclose(g_ours, g_ref, rtol=0, atol=1e-12)
    if (h, w) in ((4, 4), (8, 8), (2, 2)):  # the recipes' cases (28 and 32 px, 12 px local crops): bit-exact
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("size", [28, 12, 96, 7])
def test_small_cnn_avoids_the_ops_deterministic_cuda_refuses(size: int) -> None:
    model = SmallCNN(in_channels=1, width=4)
    with StepAudit() as audit:
        model(torch.randn(2, 1, size, size)).sum().backward()
    assert [f for f in audit.findings if f.kind == "nondeterministic"] == []
