"""Tests for the weighted kNN classifier and frozen-feature extraction (sslkit.evaluation)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sslkit.evaluation import extract_features, knn_class_scores, pixel_features, weighted_knn
from sslkit.evaluation import features as features_module

# ---------------------------------------------------------------------------------------------
# Hand-computed case. Unit vectors in 2-D:
#   train: a0=(1,0) c0, a1=(.8,.6) c1, a2=(.6,.8) c1, a3=(0,1) c0, a4=(-1,0) c1
#   test:  q0=(1,0) label 0, q1=(0,1) label 1
# q0 · train = [1, .8, .6, 0, -1] -> top-3 = a0 (c0), a1 (c1), a2 (c1)
# q1 · train = [0, .6, .8, 1, 0]  -> top-3 = a3 (c0), a2 (c1), a1 (c1)
# A majority vote says class 1 for both; with T=0.1 the single closest neighbour outweighs two:
#   score_c0 = exp(1/.1) = e^10 ~ 22026,  score_c1 = exp(.8/.1) + exp(.6/.1) = e^8 + e^6 ~ 3384.
# With T=1 the weights flatten: score_c0 = e^1 ~ 2.72 < score_c1 = e^.8 + e^.6 ~ 4.05.
# ---------------------------------------------------------------------------------------------
TRAIN_X = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0]])
TRAIN_Y = torch.tensor([0, 1, 1, 0, 1])
TEST_X = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
TEST_Y = torch.tensor([0, 1])


def test_hand_computed_scores_weighted_vote_beats_majority() -> None:
    t = 0.1
    expected = torch.tensor(
        [
            [math.exp(1.0 / t), math.exp(0.8 / t) + math.exp(0.6 / t)],
            [math.exp(1.0 / t), math.exp(0.8 / t) + math.exp(0.6 / t)],
        ],
        dtype=torch.float64,
    )
    scores = knn_class_scores(TRAIN_X, TRAIN_Y, TEST_X, num_classes=2, k=3, temperature=t)
    # Scores are returned times exp(-max_sim / T) per query; max_sim = 1 for both queries.
    torch.testing.assert_close(scores.double() * math.exp(1.0 / t), expected, rtol=1e-5, atol=0)
    assert scores.argmax(dim=1).tolist() == [0, 0]  # majority vote would give [1, 1]
    # q0 (label 0) is right, q1 (label 1) is wrong: top-1 = 1/2. No top-5 with two classes.
    res = weighted_knn(TRAIN_X, TRAIN_Y, TEST_X, TEST_Y, num_classes=2, k=3, temperature=t)
    assert res == {"knn_top1": 0.5}


def test_hand_computed_high_temperature_approaches_majority() -> None:
    t = 1.0
    c0, c1 = math.exp(1.0), math.exp(0.8) + math.exp(0.6)
    scores = knn_class_scores(TRAIN_X, TRAIN_Y, TEST_X, num_classes=2, k=3, temperature=t)
    torch.testing.assert_close(
        scores.double() / scores.double().sum(1, keepdim=True),
        torch.tensor([[c0, c1], [c0, c1]], dtype=torch.float64) / (c0 + c1),
        rtol=1e-5,
        atol=0,
    )
    assert scores.argmax(dim=1).tolist() == [1, 1]
    res = weighted_knn(TRAIN_X, TRAIN_Y, TEST_X, TEST_Y, num_classes=2, k=3, temperature=t)
    assert res == {"knn_top1": 0.5}  # now q0 is wrong and q1 right
    # k=1 is the plain nearest neighbour: a0 for q0 (c0, right), a3 for q1 (c0, wrong).
    assert weighted_knn(TRAIN_X, TRAIN_Y, TEST_X, TEST_Y, 2, k=1)["knn_top1"] == 0.5


def test_deterministic_ties() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0]])
    # Equal similarity at the k-th place: the lower train index wins.
    assert knn_class_scores(x, torch.tensor([1, 0, 0]), q, 2, k=1).argmax().item() == 1
    assert knn_class_scores(x, torch.tensor([0, 1, 1]), q, 2, k=1).argmax().item() == 0
    # Equal class scores: the lower class index is the prediction.
    res = weighted_knn(x, torch.tensor([1, 0, 1]), q, torch.tensor([0]), num_classes=2, k=2)
    assert res["knn_top1"] == 1.0
    res = weighted_knn(x, torch.tensor([1, 0, 1]), q, torch.tensor([1]), num_classes=2, k=2)
    assert res["knn_top1"] == 0.0


# ---------------------------------------------------------------------------------------------
# Independent brute-force reference (python floats, explicit loops).
# ---------------------------------------------------------------------------------------------
def _reference_knn(train_x, train_y, test_x, test_y, num_classes, k, t) -> dict[str, float]:
    def unit(v: list[float]) -> list[float]:
        n = math.sqrt(sum(a * a for a in v))
        return [a / n for a in v]

    train = [unit(v) for v in train_x.tolist()]
    labels = train_y.tolist()
    k = min(k, len(train))
    top1 = top5 = 0
    for q, y in zip(test_x.tolist(), test_y.tolist()):
        q = unit(q)
        sims = [(sum(a * b for a, b in zip(q, v)), i) for i, v in enumerate(train)]
        neighbours = sorted(sims, key=lambda s: (-s[0], s[1]))[:k]
        scores = [0.0] * num_classes
        for sim, i in neighbours:
            scores[labels[i]] += math.exp(sim / t)
        ranked = sorted(range(num_classes), key=lambda c: (-scores[c], c))
        top1 += ranked[0] == y
        top5 += y in ranked[:5]
    out = {"knn_top1": top1 / len(test_y)}
    if num_classes >= 5:
        out["knn_top5"] = top5 / len(test_y)
    return out


def _clustered(n: int, num_classes: int, dim: int, noise: float, gen: torch.Generator):
    centres = torch.randn(num_classes, dim, generator=gen)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    x = centres[y] + noise * torch.randn(n, dim, generator=gen)
    return x, y


@pytest.mark.parametrize("k", [1, 4, 20, 60, 500])
def test_matches_brute_force_reference_for_any_chunk_size(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    num_classes = 10
    train_x, train_y = _clustered(60, num_classes, 8, 1.5, gen)
    test_x, test_y = _clustered(40, num_classes, 8, 1.5, gen)
    test_x = test_x + 0.1  # not the training centres' exact distribution, still learnable
    expected = _reference_knn(train_x, train_y, test_x, test_y, num_classes, k, 0.07)
    assert 0.0 < expected["knn_top1"] < 1.0  # a non-trivial case
    for chunk in [1, 7, 40, 4096]:
        got = weighted_knn(train_x, train_y, test_x, test_y, num_classes, k, 0.07, chunk_size=chunk)
        assert got == pytest.approx(expected, abs=1e-12), chunk


@pytest.mark.parametrize("k", [2, 4, 7])
def test_ties_straddling_k_match_reference(k: int) -> None:
    # Every train point appears three times with different labels, so the k-th neighbour is
    # usually one of several equal similarities; the lower train index must win, as in the reference.
    gen = torch.Generator().manual_seed(10 + k)
    base = torch.randn(20, 8, generator=gen)
    train_x = torch.cat([base, base, base])
    train_y = torch.randint(0, 6, (60,), generator=gen)
    test_x, test_y = torch.randn(30, 8, generator=gen), torch.randint(0, 6, (30,), generator=gen)
    sim = F.normalize(test_x, dim=1) @ F.normalize(train_x, dim=1).T
    kth = sim.topk(k, dim=1).values[:, -1:]
    assert ((sim >= kth).sum(1) > k).any()  # the tie-breaking path is exercised
    expected = _reference_knn(train_x, train_y, test_x, test_y, 6, k, 0.1)
    for chunk in [1, 30]:
        assert weighted_knn(train_x, train_y, test_x, test_y, 6, k, 0.1, chunk) == pytest.approx(expected)


def test_invariant_to_scale_and_train_permutation() -> None:
    gen = torch.Generator().manual_seed(0)
    train_x, train_y = _clustered(80, 6, 5, 1.2, gen)
    test_x, test_y = _clustered(50, 6, 5, 1.2, gen)
    base = weighted_knn(train_x, train_y, test_x, test_y, 6, k=10, temperature=0.1)
    assert set(base) == {"knn_top1", "knn_top5"}
    assert 0.0 < base["knn_top1"] < 1.0
    scaled = weighted_knn(3.7 * train_x, train_y, 0.02 * test_x, test_y, 6, k=10, temperature=0.1)
    assert scaled == base
    perm = torch.randperm(80, generator=gen)
    assert weighted_knn(train_x[perm], train_y[perm], test_x, test_y, 6, k=10, temperature=0.1) == base
    # Different temperatures or k generally give different numbers: the test is not vacuous.
    assert weighted_knn(train_x, train_y, test_x, test_y, 6, k=1) != base


def test_separated_clusters_and_k_larger_than_train() -> None:
    gen = torch.Generator().manual_seed(1)
    centres = torch.eye(3, 16) * 10.0
    train_y = torch.arange(3).repeat(10)  # 30 train points
    test_y = torch.arange(3).repeat(7)
    train_x = centres[train_y] + 0.1 * torch.randn(30, 16, generator=gen)
    test_x = centres[test_y] + 0.1 * torch.randn(21, 16, generator=gen)
    assert weighted_knn(train_x, train_y, test_x, test_y, 3, k=5) == {"knn_top1": 1.0}
    # k > N_train is clipped: every training point votes, near ones dominate at T=0.1.
    huge = weighted_knn(train_x, train_y, test_x, test_y, 3, k=1000, chunk_size=4)
    assert huge == {"knn_top1": 1.0}
    assert huge == weighted_knn(train_x, train_y, test_x, test_y, 3, k=30)


def test_top5_presence_and_validation() -> None:
    x, y = torch.randn(12, 4), torch.arange(12) % 4
    assert set(weighted_knn(x, y, x, y, num_classes=4, k=3)) == {"knn_top1"}
    res = weighted_knn(x, y, x, y, num_classes=5, k=3)
    assert res["knn_top5"] == 1.0  # 5 classes: every label is in the top 5
    with pytest.raises(ValueError):
        weighted_knn(x, y, x[:, :3], y, num_classes=4)
    with pytest.raises(ValueError):
        weighted_knn(x, y, x, y, num_classes=3)  # label 3 out of range
    with pytest.raises(ValueError):
        weighted_knn(x, y, x, y, num_classes=4, k=0)


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(2)
    train_x, train_y = _clustered(3000, 20, 32, 2.0, gen)
    test_x, test_y = _clustered(500, 20, 32, 2.0, gen)
    cpu = weighted_knn(train_x, train_y, test_x, test_y, 20, k=50, chunk_size=128)
    cuda = weighted_knn(train_x.cuda(), train_y.cuda(), test_x, test_y, 20, k=50, chunk_size=128)
    # Matmul rounding (TF32 if enabled globally) may flip a rare near-tie between devices.
    assert cuda == pytest.approx(cpu, abs=0.01)
    again = weighted_knn(train_x.cuda(), train_y.cuda(), test_x, test_y, 20, k=50, chunk_size=128)
    assert again == cuda  # deterministic on CUDA


# ---------------------------------------------------------------------------------------------
# Feature extraction
# ---------------------------------------------------------------------------------------------
class _ModeRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return x


def _loader(sizes: list[int], gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[dict]:
    batches = []
    for i, b in enumerate(sizes):
        first = torch.randn(b, 3, 4, 4, generator=gen)
        if dtype == torch.uint8:
            first = torch.randint(0, 256, (b, 3, 4, 4), generator=gen, dtype=torch.uint8)
        other = torch.zeros(b, 3, 4, 4, dtype=dtype)  # a second view that must be ignored
        batches.append({"input": [first, other], "target": torch.arange(b) + 10 * i})
    return batches


def test_extract_features_shapes_norm_labels_and_mode() -> None:
    gen = torch.Generator().manual_seed(0)
    recorder = _ModeRecorder()
    encoder = nn.Sequential(recorder, nn.Flatten(), nn.Linear(48, 5), nn.Dropout(0.9))
    encoder.train()
    encoder[2].eval()  # mixed modes must be restored module by module
    loader = _loader([4, 4, 3], gen)

    feats, labels = extract_features(encoder, loader, torch.device("cpu"))
    assert feats.shape == (11, 5) and feats.dtype == torch.float32 and feats.device.type == "cpu"
    torch.testing.assert_close(feats.norm(dim=1), torch.ones(11))
    assert labels.dtype == torch.long
    assert labels.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22]
    assert recorder.seen == [False, False, False]  # ran in eval mode (dropout off)
    assert [m.training for m in encoder] == [True, True, False, True]  # restored

    with torch.no_grad():
        encoder.eval()
        raw = torch.cat([encoder(b["input"][0]) for b in loader])
    torch.testing.assert_close(feats, F.normalize(raw, dim=1))
    encoder.train()
    unnormalised, _ = extract_features(encoder, loader, torch.device("cpu"), normalize=False)
    torch.testing.assert_close(unnormalised, raw)
    assert encoder.training


def test_extract_features_amp_and_restore_on_error() -> None:
    gen = torch.Generator().manual_seed(1)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(48, 6))
    loader = _loader([5, 2], gen)
    ref, _ = extract_features(encoder, loader, torch.device("cpu"))
    amp, _ = extract_features(encoder, loader, torch.device("cpu"), amp_dtype=torch.bfloat16)
    assert amp.dtype == torch.float32
    torch.testing.assert_close(amp, ref, atol=3e-2, rtol=0)
    assert not torch.equal(amp, ref)  # autocast was really applied

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    broken = nn.Sequential(nn.Flatten(), Boom()).train()
    with pytest.raises(RuntimeError, match="boom"):
        extract_features(broken, loader, torch.device("cpu"))
    assert all(m.training for m in broken.modules())


def test_pixel_features_are_normalised_flat_pixels() -> None:
    gen = torch.Generator().manual_seed(2)
    loader = _loader([3, 2], gen, dtype=torch.uint8)
    feats, labels = pixel_features(loader)
    pixels = torch.cat([b["input"][0] for b in loader]).flatten(1).float()
    assert feats.shape == (5, 48) and feats.dtype == torch.float32
    torch.testing.assert_close(feats, pixels / pixels.norm(dim=1, keepdim=True))
    assert labels.tolist() == [0, 1, 2, 10, 11]


# ---------------------------------------------------------------------------------------------
# Distributed gather with unequal per-rank sizes (two gloo processes on CPU).
# ---------------------------------------------------------------------------------------------
def _rank_loader(rank: int, sizes: list[int]) -> list[dict]:
    batches = []
    offset = 0
    for b in sizes:
        idx = torch.arange(offset, offset + b) + 100 * rank
        x = (idx.float()[:, None] + torch.arange(48).float()).view(b, 3, 4, 4)
        batches.append({"input": [x], "target": idx})
        offset += b
    return batches


#: A sampler's shards of 5 samples over 2 ranks: rank 1 is padded with sample 0 again.
_PADDED_SHARDS = [[0, 2, 4], [1, 3, 0]]


def _padded_loader(rank: int) -> list[dict]:
    idx = torch.tensor(_PADDED_SHARDS[rank])
    x = (idx.float()[:, None] + torch.arange(48).float()).view(-1, 3, 4, 4)
    return [{"input": [x], "target": idx % 3, "data_idx": idx}]


_RANK_SIZES = {  # name -> per-rank batch sizes
    "unequal": [[2, 2, 1], [2, 1]],
    "empty_rank": [[2, 1], []],
}


def _dist_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        features_module._GATHER_ROWS = 2  # force several gather blocks
        results = {}
        for name, sizes in _RANK_SIZES.items():
            results[name] = pixel_features(_rank_loader(rank, sizes[rank]))
        results["padded"] = pixel_features(_padded_loader(rank))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_distributed_gather_unequal_sizes(tmp_path) -> None:
    from sslkit.distributed import start_processes

    start_processes(_dist_worker, (2, f"file://{tmp_path}/store", str(tmp_path)), 2)
    for name, sizes in _RANK_SIZES.items():
        expected_batches = _rank_loader(0, sizes[0]) + _rank_loader(1, sizes[1])
        pixels = torch.cat([b["input"][0] for b in expected_batches]).flatten(1)
        expected_labels = torch.cat([b["target"] for b in expected_batches])
        for rank in range(2):
            feats, labels = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert labels.tolist() == expected_labels.tolist(), (name, rank)
            torch.testing.assert_close(feats, F.normalize(pixels, dim=1))
    # with data_idx: each sample once, in dataset order, as one process would see them
    whole = (torch.arange(5).float()[:, None] + torch.arange(48).float())
    for rank in range(2):
        feats, labels = torch.load(tmp_path / f"rank{rank}.pt")["padded"]
        assert labels.tolist() == [i % 3 for i in range(5)]
        torch.testing.assert_close(feats, F.normalize(whole, dim=1))
