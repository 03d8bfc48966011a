"""cross_entropy_at is F.cross_entropy (values and gradients), written without NLLLoss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sslkit.methods.infonce import cross_entropy_at


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_cross_entropy_with_gradients(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(16, 33, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, 33, (16,), generator=g)
    ours = cross_entropy_at(logits, target)
    ref = F.cross_entropy(logits.float(), target)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6)
    (g_ours,), (g_ref,) = torch.autograd.grad(ours, logits), torch.autograd.grad(ref, logits)
    assert torch.allclose(g_ours.float(), g_ref.float(), atol=1e-6)


def test_hand_computed_and_masked_columns() -> None:
    # row 0: logits [0, ln 3], positive 1: -log(3 / 4); row 1: [-inf, 2], positive 1: 0
    logits = torch.tensor([[0.0, math.log(3.0)], [float("-inf"), 2.0]])
    loss = cross_entropy_at(logits, torch.tensor([1, 1]))
    assert loss.item() == pytest.approx((-math.log(3 / 4) + 0.0) / 2, rel=1e-6)
