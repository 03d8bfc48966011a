"""Tests for StatefulDistributedSampler: sharding, per-epoch shuffling, mid-epoch resume."""

from __future__ import annotations

import pytest

from sslkit.data import StatefulDistributedSampler as Sampler


def indices(s: Sampler) -> list[int]:
    return [i for _, i in s]


@pytest.mark.parametrize("n", [10, 11])
def test_two_replicas_drop_last_disjoint(n: int) -> None:
    shards = [indices(Sampler(n, num_replicas=2, rank=r, seed=3)) for r in (0, 1)]
    assert [len(s) for s in shards] == [n // 2] * 2
    assert not set(shards[0]) & set(shards[1])
    assert len(set(shards[0]) | set(shards[1])) == 2 * (n // 2)


def test_two_replicas_pad_cover_everything() -> None:
    samplers = [Sampler(11, num_replicas=2, rank=r, drop_last=False) for r in (0, 1)]
    shards = [indices(s) for s in samplers]
    assert [len(s) for s in shards] == [6, 6] and samplers[0].num_samples == 6
    assert set(shards[0]) | set(shards[1]) == set(range(11))
    assert len(shards[0]) + len(shards[1]) - len(set(shards[0] + shards[1])) == 1  # one repeat


def test_tiny_dataset_padding_repeats() -> None:
    shards = [indices(Sampler(3, num_replicas=4, rank=r, drop_last=False, shuffle=False)) for r in range(4)]
    assert shards == [[0], [1], [2], [0]]
    assert indices(Sampler(3, num_replicas=4, rank=0)) == []  # drop_last: nothing left


def test_no_shuffle_is_strided() -> None:
    s = Sampler(7, num_replicas=2, rank=1, shuffle=False, drop_last=False)
    assert indices(s) == [1, 3, 5, 0]


def test_epochs_reshuffle_deterministically() -> None:
    s = Sampler(50, seed=1)
    first = list(s)
    assert all(e == 0 for e, _ in first) and sorted(i for _, i in first) == list(range(50))
    s.set_epoch(1)
    second = list(s)
    assert all(e == 1 for e, _ in second)
    assert [i for _, i in first] != [i for _, i in second]
    again = Sampler(50, seed=1)
    again.set_epoch(1)
    assert list(again) == second
    other_seed = Sampler(50, seed=2)
    other_seed.set_epoch(1)
    assert list(other_seed) != second


def test_set_start_resumes_where_uninterrupted_run_was() -> None:
    full = Sampler(23, num_replicas=2, rank=1, seed=7)
    full.set_epoch(4)
    uninterrupted = list(full)
    resumed = Sampler(23, num_replicas=2, rank=1, seed=7)
    resumed.set_epoch(4)
    resumed.set_start(5)
    assert len(resumed) == full.num_samples - 5 == 6
    assert list(resumed) == uninterrupted[5:]
    resumed.set_epoch(4)  # the same epoch again keeps the start (trainers call set_epoch on resume)
    assert len(resumed) == 6
    resumed.set_epoch(5)
    assert len(resumed) == 11 and resumed.start == 0
    with pytest.raises(ValueError):
        resumed.set_start(12)


def test_state_dict_roundtrip() -> None:
    s = Sampler(40, num_replicas=2, rank=0, seed=9)
    s.set_epoch(3)
    s.set_start(8)
    t = Sampler(40, num_replicas=2, rank=0, seed=9)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.start) == (3, 8)
    assert list(t) == list(s)


def test_load_state_with_fewer_replicas_keeps_global_position() -> None:
    n = 40
    consumed = set()
    for r in (0, 1):
        s = Sampler(n, num_replicas=2, rank=r, seed=2)
        s.set_epoch(1)
        consumed |= set(indices(s)[:6])
        state = s.state_dict()
    state["start"] = 6
    single = Sampler(n, num_replicas=1, rank=0, seed=2)
    single.load_state_dict(state)
    assert single.start == 12
    assert set(indices(single)) == set(range(n)) - consumed


def test_load_state_from_other_dataset_restarts_epoch() -> None:
    s = Sampler(40, seed=2)
    s.set_epoch(2)
    s.set_start(10)
    t = Sampler(30, seed=2)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.start) == (2, 0)


def test_invalid_rank() -> None:
    with pytest.raises(ValueError):
        Sampler(10, num_replicas=2, rank=2)
