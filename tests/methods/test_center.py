"""The one centre of the DINO family (sslkit/methods/center.py): an update's mean over its micro-batches, weighted
rows, an update without weight, and what a checkpoint keeps."""

from __future__ import annotations

import pytest
import torch

from sslkit.methods.center import Center


def test_unweighted_rows_move_the_centre_by_the_mean_of_every_micro_batch() -> None:
    """DINO's CLS centre: c <- m c + (1 - m) mean over all rows of the update's micro-batches (two global crops
    each), not the mean of the micro-batches' means."""
    g = torch.Generator().manual_seed(0)
    first = [torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)]
    second = [torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)]
    center = Center(4, momentum=0.9)
    center.accumulate(first)
    assert torch.equal(center.value, torch.zeros(1, 4))  # nothing moves before the update
    center.accumulate(second)
    center.update()
    mean = torch.cat(first + second).mean(dim=0, keepdim=True)
    torch.testing.assert_close(center.value, 0.1 * mean)
    # the next update starts from the sums of nothing: the mean of its own rows only
    third = [torch.full((2, 4), 5.0)]
    center.accumulate(third)
    center.update()
    torch.testing.assert_close(center.value, 0.9 * (0.1 * mean) + 0.1 * 5.0)


def test_weighted_rows_count_by_their_weight_and_an_update_without_weight_leaves_the_centre() -> None:
    """iBOT's patch centre: padding slots (weight 0) do not count, a row of weight 2 counts twice; [B, M, K]
    logits with [B, M] weights are rows too."""
    logits = torch.tensor([[[1.0, 0.0], [3.0, 2.0]], [[100.0, 100.0], [5.0, 4.0]]])  # [B=2, M=2, K=2]
    weights = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    center = Center(2, momentum=0.5)
    center.accumulate([logits], [weights])
    center.update()
    expected = (1 * torch.tensor([1.0, 0.0]) + 2 * torch.tensor([3.0, 2.0]) + torch.tensor([5.0, 4.0])) / 4
    torch.testing.assert_close(center.value[0], 0.5 * expected)
    before = center.value.clone()
    center.accumulate([logits], [torch.zeros(2, 2)])
    center.update()
    assert torch.equal(center.value, before)


def test_only_the_centre_is_saved_and_the_momentum_is_checked() -> None:
    center = Center(3)
    center.accumulate([torch.ones(2, 3)])
    assert list(center.state_dict()) == ["value"]  # the pending sums are empty whenever a checkpoint is written
    with pytest.raises(ValueError, match=r"dino center_momentum must be in \[0, 1\], got 1.5"):
        Center(3, momentum=1.5)
