"""The protocols of sslkit bench against independent computations: kNN of several k against a written-out loop,
mAP@R and recall@k on hand-computed cases, the bootstrap against its formula, the logistic regression against
scikit-learn's, the grid of probes against one probe trained alone, each corruption against its definition."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sslkit.evaluation import corruptions as C
from sslkit.evaluation.knn import knn_predictions, ranked_neighbours, weighted_knn
from sslkit.evaluation.linear import cosine_lr
from sslkit.evaluation.probes import (
    GridSettings,
    fit_logistic,
    logistic_predict,
    row_space,
    shots_subset,
    stratified_split,
    train_probe_grid,
)
from sslkit.evaluation.retrieval import retrieval_scores
from sslkit.evaluation.stats import bootstrap_indices, bootstrap_interval, draws_summary, paired_difference

# ------------------------------------------------------------------------------------------------ kNN


def _knn_by_hand(train: torch.Tensor, labels: list[int], query: torch.Tensor, classes: int, k: int,
                 t: float) -> list[int]:
    """The protocol written out: cosine similarities, the k most similar (ties to the lower index), votes
    exp(s / T) summed per class, the best class (ties to the lower class)."""
    out = []
    for q in query.double():
        sims = [float(F.cosine_similarity(q, x.double(), dim=0)) for x in train]
        order = sorted(range(len(sims)), key=lambda i: (-sims[i], i))[:k]
        score = [0.0] * classes
        for i in order:
            score[labels[i]] += math.exp(sims[i] / t)
        out.append(max(range(classes), key=lambda c: (score[c], -c)))
    return out


def test_knn_of_several_k_from_one_pass_equals_the_protocol_written_out() -> None:
    g = torch.Generator().manual_seed(0)
    train = torch.randn(40, 6, generator=g)
    train[7] = train[3]  # an exact tie among the neighbours
    train[21] = train[3] * 2.0
    labels = torch.randint(0, 4, (40,), generator=g)
    query = torch.cat([torch.randn(12, 6, generator=g), train[3:4]])
    got = knn_predictions(train, labels, query, 4, [1, 3, 10, 40], 0.5, chunk_size=5)
    for k in (1, 3, 10, 40):
        assert got[k].tolist() == _knn_by_hand(train, labels.tolist(), query, 4, k, 0.5), k
        acc = weighted_knn(train, labels, query, torch.zeros(13, dtype=torch.long), 4, k, 0.5)["knn_top1"]
        assert acc == pytest.approx(float((got[k] == 0).double().mean()))


def test_ranked_neighbours_order_equal_similarities_by_index() -> None:
    sim = torch.tensor([[0.5, 0.75, 0.5, 0.75, 0.25]])
    vals, idx = ranked_neighbours(sim, 4)
    assert idx.tolist() == [[1, 3, 0, 2]] and vals.tolist() == [[0.75, 0.75, 0.5, 0.5]]


# ------------------------------------------------------------------------------------------------ retrieval


def test_map_at_r_and_recall_at_k_on_a_hand_computed_case() -> None:
    # database of 1-d directions: the similarity ranks them by angle to the query
    angles = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 3.0])
    train = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    query = torch.tensor([[1.0, -0.01]])  # ranks the database 0, 1, 2, 3, 4, 5
    # label 0: R = 3; relevant at ranks 1, 3, 5 -> within R: ranks 1 and 3: (1/1 + 2/3) / 3
    s = retrieval_scores(train, labels, query, torch.tensor([0]), ks=(1, 2))
    assert s["map_at_r"].item() == pytest.approx((1 + 2 / 3) / 3)
    assert s["recall_at_1"].item() == 1.0 and s["recall_at_2"].item() == 1.0
    # label 1: R = 3; relevant at ranks 2, 4, 6 -> within R: rank 2 only: (1/2) / 3; nothing at rank 1
    s = retrieval_scores(train, labels, query, torch.tensor([1]), ks=(1, 2))
    assert s["map_at_r"].item() == pytest.approx(0.5 / 3)
    assert s["recall_at_1"].item() == 0.0 and s["recall_at_2"].item() == 1.0


def test_retrieval_of_a_perfect_embedding_scores_one() -> None:
    labels = torch.arange(5).repeat_interleave(4)
    train = F.one_hot(labels, 5).float() + 0.01 * torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    s = retrieval_scores(train, labels, F.one_hot(torch.arange(5), 5).float(), torch.arange(5))
    assert s["map_at_r"].tolist() == [1.0] * 5 and s["recall_at_1"].tolist() == [1.0] * 5


# ------------------------------------------------------------------------------------------------ spreads


def test_the_bootstrap_is_the_percentile_of_resampled_means() -> None:
    hits = (torch.rand(200, generator=torch.Generator().manual_seed(2)) < 0.7).double()
    got = bootstrap_interval(hits, resamples=300, level=0.9, seed=5)
    idx = bootstrap_indices(200, 300, 5)
    means = sorted(float(hits[row].mean()) for row in idx)
    assert got["value"] == pytest.approx(float(hits.mean()))
    assert got["low"] == pytest.approx(float(np.quantile(means, 0.05)))
    assert got["high"] == pytest.approx(float(np.quantile(means, 0.95)))
    assert got["se"] == pytest.approx(float(np.std(means, ddof=1)))


def test_the_bootstrap_spread_of_an_accuracy_is_its_binomial_standard_error() -> None:
    p, n = 0.8, 4000
    hits = torch.zeros(n, dtype=torch.float64)
    hits[: int(p * n)] = 1
    got = bootstrap_interval(hits, resamples=2000, seed=0)
    formula = math.sqrt(p * (1 - p) / n)
    assert got["se"] == pytest.approx(formula, rel=0.1)
    assert got["high"] - got["low"] == pytest.approx(2 * 1.96 * formula, rel=0.15)


def test_a_paired_difference_is_supported_only_beyond_the_spread() -> None:
    g = torch.Generator().manual_seed(3)
    a = (torch.rand(1000, generator=g) < 0.8).double()
    same = paired_difference(a, a.clone())
    assert same["difference"] == 0 and not same["supported"]
    flipped = a.clone()
    flipped[torch.randperm(1000, generator=g)[:4]] = 1 - flipped[:4]  # a handful of images: noise
    assert not paired_difference(a, flipped)["supported"]
    worse = a.clone()
    worse[a == 1] = (torch.rand(int(a.sum()), generator=g) < 0.8).double()  # 16 points lower
    d = paired_difference(a, worse)
    assert d["supported"] and d["low"] > 0


def test_the_spread_of_draws() -> None:
    s = draws_summary([0.5, 0.7, 0.6])
    assert s["value"] == pytest.approx(0.6) and s["std"] == pytest.approx(0.1) and s["se"] == pytest.approx(
        0.1 / math.sqrt(3))
    assert draws_summary([0.4])["std"] == 0.0


# ------------------------------------------------------------------------------------------------ probes


def test_logistic_regression_matches_scikit_learn() -> None:
    sklearn = pytest.importorskip("sklearn.linear_model")
    g = torch.Generator().manual_seed(4)
    centers = torch.randn(3, 5, generator=g) * 2
    y = torch.arange(3).repeat(20)
    x = centers[y] + torch.randn(60, 5, generator=g)
    for c in (0.1, 1.0):
        w, b = fit_logistic(x, y, 3, c=c)
        ref = sklearn.LogisticRegression(C=c, max_iter=10_000, tol=1e-10).fit(x.double().numpy(), y.numpy())
        assert np.allclose(w.numpy(), ref.coef_, atol=1e-4), c
        assert np.allclose(b.numpy(), ref.intercept_, atol=1e-4), c
        assert (logistic_predict(w, b, x).numpy() == ref.predict(x.numpy())).all()


def test_the_grid_trains_each_probe_as_it_would_be_trained_alone() -> None:
    g = torch.Generator().manual_seed(6)
    n, d, classes = 90, 7, 4
    feats = {"a": torch.randn(n, d, generator=g), "b": torch.randn(n, 3, generator=g)}
    labels = torch.randint(0, classes, (n,), generator=g)
    s = GridSettings(lrs=(0.05, 0.5), weight_decays=(0.0, 0.01), epochs=3, batch_size=32, seed=11)
    grid = train_probe_grid(feats, labels, classes, s)
    for choice in ("a", "b"):
        for cell, (lr, wd) in enumerate(grid.cells):
            # one nn.Linear, torch's SGD, the same start (N(0, 0.01) from the seed), batches and cosine schedule
            head = torch.nn.Linear(feats[choice].shape[1], classes)
            with torch.no_grad():
                head.weight.copy_(torch.randn(classes, feats[choice].shape[1],
                                              generator=torch.Generator().manual_seed(11)) * 0.01)
                head.bias.zero_()
            opt = torch.optim.SGD(head.parameters(), lr=s.scaled(lr), momentum=0.9, weight_decay=wd)
            total, step = 3 * -(-n // 32), 0
            for epoch in range(3):
                order = torch.randperm(n, generator=torch.Generator().manual_seed(11 * 100_003 + epoch))
                for start in range(0, n, 32):
                    idx = order[start : start + 32]
                    for group in opt.param_groups:
                        group["lr"] = s.scaled(lr) * cosine_lr(1.0, step, total)
                    opt.zero_grad()
                    F.cross_entropy(head(feats[choice][idx]), labels[idx]).backward()
                    opt.step()
                    step += 1
            w, b = grid.classifier(choice, cell)
            assert torch.allclose(w, head.weight, atol=1e-6, rtol=1e-5), (choice, lr, wd)
            assert torch.allclose(b, head.bias, atol=1e-6, rtol=1e-5), (choice, lr, wd)
    # a larger lr moved further from the shared start: the cells are not one classifier
    w0, _ = grid.classifier("a", 0)
    w2, _ = grid.classifier("a", 2)
    assert not torch.allclose(w0, w2)


def test_fewer_images_than_dimensions_train_in_their_row_space_to_the_same_classifiers() -> None:
    g = torch.Generator().manual_seed(8)
    n, d, classes = 40, 96, 5
    x = torch.randn(n, 12, generator=g) @ torch.randn(12, d, generator=g)  # rank 12: most directions empty
    labels = torch.randint(0, classes, (n,), generator=g)
    basis = row_space(x)
    assert basis is not None and basis.shape == (d, n)
    assert torch.allclose(basis.T @ basis, torch.eye(n, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(x.double() @ basis @ basis.T, x.double(), atol=1e-6)  # the rows lie in it
    assert row_space(torch.randn(10, 4)) is None  # more images than dimensions: nothing to gain
    s = GridSettings(lrs=(0.05, 0.5), weight_decays=(0.0, 0.05), epochs=6, batch_size=16, seed=3)
    reduced = train_probe_grid({"a": x}, labels, classes, s)
    direct = train_probe_grid({"a": x}, labels, classes, s, reduce=False)
    for cell in range(len(direct.cells)):
        # the whole weight, its start's part outside the rows (decayed, never moved by a gradient) included
        (w, b), (w0, b0) = reduced.classifier("a", cell), direct.classifier("a", cell)
        assert torch.allclose(w, w0, atol=2e-6, rtol=1e-4), cell
        assert torch.allclose(b, b0, atol=2e-6, rtol=1e-4), cell
    # the same optimum (scikit-learn's objective written out): both fits stop on scikit-learn's ftol, so which one
    # ends a few 1e-8 lower depends on the thread count's summation order, not on the reduction
    w, b = fit_logistic(x, labels, classes, c=0.5)
    w0, b0 = fit_logistic(x, labels, classes, c=0.5, reduce=False)

    def objective(w: torch.Tensor, b: torch.Tensor) -> float:
        return float(0.5 * (w * w).sum() + 0.5 * F.cross_entropy(x.double() @ w.T + b, labels, reduction="sum"))

    assert abs(objective(w, b) - objective(w0, b0)) < 1e-6
    assert torch.allclose(w, w0, atol=1e-3) and torch.equal(logistic_predict(w, b, x), logistic_predict(w0, b0, x))


def _bench_settings() -> dict:
    from omegaconf import OmegaConf

    from sslkit.config.schema import schema

    found = OmegaConf.to_container(schema().eval.bench, resolve=True)
    assert isinstance(found, dict)
    return found


def _fashion_features(n_train: int, n_test: int, scale: float) -> tuple:
    """A linear backbone: Fashion-MNIST's pixels through a fixed random projection to 48 dimensions, times
    ``scale`` (a random init's features are about 25 times smaller than a trained one's)."""
    from sslkit.data.sources import DEBIAN_FASHION_MNIST, build_source
    from sslkit.tools.bench.protocols import Features

    if not __import__("pathlib").Path(DEBIAN_FASHION_MNIST).is_dir():
        pytest.skip("no Fashion-MNIST here (apt-get install dataset-fashion-mnist)")
    proj = torch.randn(784, 48, generator=torch.Generator().manual_seed(0)) / 28
    out = []
    for split, n in (("train", n_train), ("test", n_test)):
        src = build_source("fashion_mnist", split)
        x = (src.images[:n].flatten(1).float() / 255) @ proj * scale  # type: ignore[attr-defined]
        out.append(Features({"pool": x.numpy(), "labels": src.labels[:n].numpy()}))  # type: ignore[attr-defined]
    return tuple(out)


def test_the_linear_probe_converges_to_scikit_learns_logistic_regression_at_2000_images() -> None:
    """The grid (standardised features, at least linear.min_steps steps) lands within a point of a converged
    logistic regression chosen the same way (scikit-learn's, its C picked on the same validation split), at any
    scale of the features: 10 passes of 8 steps, on the raw features, credited a backbone 25 times smaller with
    an accuracy a converged fit does not give."""
    sk = pytest.importorskip("sklearn.linear_model")
    from sslkit.tools.bench.protocols import fit_linear, linear_hits

    s = _bench_settings()
    train, test = _fashion_features(2000, 1000, 1.0)
    chosen, details = fit_linear(train, 10, s, torch.device("cpu"))
    got = float(linear_hits(chosen, test, torch.device("cpu")).mean())
    assert details["steps"] >= s["linear"]["min_steps"] and details["standardize"] and details["at_edge"] is None
    fit, val = stratified_split(train.labels, float(s["linear"]["val_fraction"]), int(s["seed"]))
    x, y = torch.from_numpy(train.arrays["pool"]).double(), train.labels
    mean, std = x[fit].mean(0), x[fit].std(0)
    z, zt = ((x - mean) / std).numpy(), ((torch.from_numpy(test.arrays["pool"]).double() - mean) / std).numpy()
    fits = [sk.LogisticRegression(C=c, max_iter=5000).fit(z[fit], y[fit].numpy()) for c in (0.01, 0.1, 1.0, 10.0)]
    best = max(fits, key=lambda m: (m.predict(z[val]) == y[val].numpy()).mean())
    reference = float((best.predict(zt) == test.labels.numpy()).mean())
    assert abs(got - reference) <= 0.01, (got, reference)
    # a backbone whose features are 25 times smaller is judged the same (to float rounding of the standardisation)
    small_train, small_test = _fashion_features(2000, 1000, 1 / 25)
    small, _ = fit_linear(small_train, 10, s, torch.device("cpu"))
    assert abs(float(linear_hits(small, small_test, torch.device("cpu")).mean()) - got) <= 0.003


def test_a_choice_at_the_grids_edge_extends_the_grid_and_is_flagged_when_still_there() -> None:
    from sslkit.tools.bench.protocols import fit_linear

    s = _bench_settings()
    train, _ = _fashion_features(600, 10, 1.0)
    s["linear"].update(lrs=[1e-4, 2e-4], weight_decays=[0.0, 1e-4], min_steps=50, extend=1)  # all too small
    _, details = fit_linear(train, 10, s, torch.device("cpu"))
    assert details["extended_lrs"] == pytest.approx([4e-4, 1e-3, 2e-3])
    scores = [row["val_mean_accuracy"] for row in details["grid"]]
    assert scores[-1] > scores[1] and details["chosen"]["lr"] == pytest.approx(2e-3)
    assert details["classifiers"] == 5 * 2 and details["at_edge"] == "high"
    s["linear"].update(extend=0)
    assert fit_linear(train, 10, s, torch.device("cpu"))[1]["extended_lrs"] == []


def test_the_validation_split_is_stratified_seeded_and_disjoint() -> None:
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 2 + [3])
    fit, val = stratified_split(labels, 0.1, seed=3)
    assert sorted(torch.cat([fit, val]).tolist()) == list(range(83))
    counts = torch.bincount(labels[val], minlength=4).tolist()
    assert counts == [5, 3, 1, 0]  # round(10 %), at least one of a class of two, none of a class of one
    assert torch.equal(stratified_split(labels, 0.1, seed=3)[1], val)
    assert not torch.equal(stratified_split(labels, 0.1, seed=4)[1], val)
    picked = shots_subset(labels, 2, seed=1)
    assert torch.bincount(labels[picked], minlength=4).tolist() == [2, 2, 2, 1]


# ------------------------------------------------------------------------------------------------ corruptions


def _image(channels: int = 3, size: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (channels, size, size), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def test_gaussian_noise_is_its_definition_and_the_same_for_the_same_seed() -> None:
    x = _image()
    got = C.corrupt(x, "gaussian_noise", 3, "imagenet", seed=9)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    want = ((x.double() / 255 + 0.18 * noise).clamp(0, 1) * 255).to(torch.uint8)
    assert torch.equal(got, want)
    assert torch.equal(C.corrupt(x, "gaussian_noise", 3, "imagenet", seed=9), got)
    assert not torch.equal(C.corrupt(x, "gaussian_noise", 3, "imagenet", seed=10), got)


def test_gaussian_blur_is_scipys_gaussian_filter_per_channel() -> None:
    ndimage = pytest.importorskip("scipy.ndimage")
    x = _image(3, 24, 1)
    for table, severity in (("imagenet", 1), ("imagenet", 3), ("cifar", 5)):
        sigma = C.SEVERITY_TABLES[table]["gaussian_blur"][severity - 1]
        ref = np.stack([ndimage.gaussian_filter(x[c].double().numpy() / 255, sigma, mode="nearest", truncate=4.0)
                        for c in range(3)])
        want = (np.clip(ref, 0, 1) * 255).astype(np.uint8)
        got = C.corrupt(x, "gaussian_blur", severity, table).numpy()
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # float64 sums in another order
        assert (got == want).mean() > 0.99


def test_contrast_is_its_definition() -> None:
    x = _image(1, 16, 2)
    got = C.corrupt(x, "contrast", 5, "cifar")
    f = x.double() / 255
    m = f.mean(dim=(1, 2), keepdim=True)
    assert torch.equal(got, (((f - m) * 0.15 + m).clamp(0, 1) * 255).to(torch.uint8))


def test_jpeg_is_pils_round_trip_through_rgb() -> None:
    from PIL import Image

    x = _image(1, 16, 3)
    buf = io.BytesIO()
    Image.fromarray(x[0].numpy(), "L").convert("RGB").save(buf, "JPEG", quality=10)
    want = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("L"))
    assert np.array_equal(C.corrupt(x, "jpeg", 4, "imagenet")[0].numpy(), want)


def test_severities_grow_and_bad_arguments_are_refused() -> None:
    x = _image(3, 24, 4)
    far = [float((C.corrupt(x, "contrast", s, "imagenet").double() - x.double()).abs().mean()) for s in (1, 3, 5)]
    assert far[0] < far[1] < far[2]
    assert C.table_for("auto", 28) == "cifar" and C.table_for("auto", 224) == "imagenet"
    with pytest.raises(ValueError, match="severity"):
        C.corrupt(x, "contrast", 6)
    with pytest.raises(ValueError, match="unknown corruption"):
        C.corrupt(x, "fog", 1)


# ------------------------------------------------------------------------------------------------ attentive probe


def _vjepa_pool_by_hand(p: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """V-JEPA's AttentivePooler (one query, complete block) written out with its own operations: q = query W_q;
    k, v from the LayerNormed tokens; per head softmax(q k^T / sqrt(d_h)) v; the output projection added to the
    query; then the query plus fc2(GELU(fc1(LayerNorm(query))))."""
    b, _, d = x.shape
    h = p.num_heads
    dh = d // h
    xn = F.layer_norm(x, (d,), p.norm1.weight, p.norm1.bias)
    kv = xn @ p.kv.weight.T + p.kv.bias
    k, v = kv[..., :d], kv[..., d:]
    q = (p.query[0, 0] @ p.q.weight.T + p.q.bias).expand(b, d)
    heads = []
    for i in range(h):
        s = slice(i * dh, (i + 1) * dh)
        att = torch.softmax(torch.einsum("bd,bnd->bn", q[:, s], k[..., s]) / math.sqrt(dh), dim=1)
        heads.append(torch.einsum("bn,bnd->bd", att, v[..., s]))
    y = torch.cat(heads, dim=1) @ p.proj.weight.T + p.proj.bias
    z = p.query[0, 0] + y
    zn = F.layer_norm(z, (d,), p.norm2.weight, p.norm2.bias)
    hidden = F.gelu(zn @ p.fc1.weight.T + p.fc1.bias)
    return z + hidden @ p.fc2.weight.T + p.fc2.bias


def test_the_attentive_classifier_is_vjepas_pooler_written_out() -> None:
    from sslkit.evaluation.attentive import AttentiveClassifier

    torch.manual_seed(0)
    probe = AttentiveClassifier(12, 5, num_heads=3)
    x = torch.randn(4, 7, 12)
    assert torch.allclose(probe.pool(x), _vjepa_pool_by_hand(probe, x), atol=1e-5)
    assert torch.allclose(probe(x), _vjepa_pool_by_hand(probe, x) @ probe.linear.weight.T + probe.linear.bias,
                          atol=1e-5)
    # V-JEPA's init: a normal of std 0.02 (its trunc_normal_ cuts at +-2 absolute: 100 std, so nothing is cut), the
    # output projection and the MLP's second layer divided by sqrt(2), biases 0
    torch.manual_seed(1)
    big = AttentiveClassifier(384, 3, num_heads=6)
    with torch.no_grad():
        assert big.q.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert big.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2), rel=0.03)
        assert big.fc2.weight.std().item() == pytest.approx(0.02 / math.sqrt(2), rel=0.03)
        assert big.query.std().item() == pytest.approx(0.02, rel=0.15)
        assert float(big.kv.bias.abs().max()) == 0.0
    with pytest.raises(ValueError, match="heads"):
        AttentiveClassifier(10, 2, num_heads=3)


def test_the_attentive_grid_trains_each_probe_as_it_would_be_trained_alone() -> None:
    from sslkit.evaluation.attentive import AttentiveSettings, predict_attentive, train_attentive_grid

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (40,), generator=g)
    signal = 3 * F.one_hot(labels, 8).float()[:, None, :]  # class c lifts feature c (a LayerNorm keeps that)
    tokens = (torch.randn(40, 5, 8, generator=g) + signal).half().numpy()
    rows = torch.arange(3, 40)  # rows of the array, not all of them
    grid = AttentiveSettings(lrs=(1e-3, 1e-2), weight_decays=(0.0, 0.1), epochs=3, batch_size=16, num_heads=2)
    probes = train_attentive_grid(tokens, rows, labels[rows], 3, grid, torch.device("cpu"))
    for cell, (lr, wd) in enumerate(grid.cells):
        alone = train_attentive_grid(tokens, rows, labels[rows], 3, AttentiveSettings(
            (lr,), (wd,), 3, 16, 2), torch.device("cpu"))[0]
        for (name, a), b in zip(probes[cell].state_dict().items(), alone.state_dict().values()):
            assert torch.equal(a, b), (cell, name)
    # trained longer on separable tokens it beats chance; predictions come back in the order asked
    longer = train_attentive_grid(tokens, rows, labels[rows], 3, AttentiveSettings((1e-2,), (0.0,), 30, 16, 2),
                                  torch.device("cpu"))
    pred = predict_attentive(longer, tokens, rows.flip(0), torch.device("cpu"), batch_size=7)[0]
    assert float((pred == labels[rows.flip(0)]).double().mean()) > 0.8
    assert torch.equal(pred.flip(0), predict_attentive(longer, tokens, rows, torch.device("cpu"))[0])


def test_the_attentive_schedule_is_a_cosine_to_zero_without_warmup() -> None:
    from sslkit.evaluation.attentive import attentive_lr

    assert attentive_lr(1e-3, 0, 100) == pytest.approx(1e-3)
    assert attentive_lr(1e-3, 50, 100) == pytest.approx(0.5e-3)
    assert attentive_lr(1e-3, 100, 100) == pytest.approx(0.0, abs=1e-15)


# ------------------------------------------------------------------------------------------------ mIoU's bootstrap


def test_the_miou_bootstrap_resamples_images_and_sums_before_dividing() -> None:
    from sslkit.evaluation.dense import area_stats, image_area_stats, segmentation_metrics
    from sslkit.evaluation.stats import bootstrap_weights, miou_statistic

    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 4, (6, 5, 5), generator=g)
    target[0, 0, 0] = 255
    pred = torch.where(torch.rand(6, 5, 5, generator=g) < 0.7, target.clamp(max=3), torch.randint(0, 4, (6, 5, 5),
                                                                                                 generator=g))
    per = image_area_stats(pred, target, 4)
    assert per.shape == (6, 2, 4)
    whole = area_stats(pred, target, 4)
    assert torch.equal(per.sum(0), whole[:2])  # image by image, the same pixels
    ones = torch.ones(1, 6, dtype=torch.float64)
    assert float(miou_statistic(ones, per)[0]) == pytest.approx(segmentation_metrics(whole)["miou"])
    # a resample's mIoU is that of the images it drew, counted as often as drawn (not a mean of per-image IoUs)
    w = bootstrap_weights(6, resamples=3, seed=1)
    idx = bootstrap_indices(6, resamples=3, seed=1)
    for r in range(3):
        drawn = segmentation_metrics(area_stats(pred[idx[r]], target[idx[r]], 4))["miou"]
        assert float(miou_statistic(w[r:r + 1], per)[0]) == pytest.approx(drawn)
    m = bootstrap_interval(per, miou_statistic, resamples=200, seed=0)
    assert m["low"] <= m["value"] <= m["high"] and m["se"] > 0
    same = paired_difference(per, per, miou_statistic, resamples=100)
    assert same["difference"] == 0.0 and not same["supported"]


def test_the_robustness_spread_resamples_clean_and_corrupted_hits_of_the_same_images() -> None:
    from sslkit.evaluation.stats import bootstrap_indices as idx_of
    from sslkit.evaluation.stats import bootstrap_weights, relative_statistic

    g = torch.Generator().manual_seed(0)
    clean = (torch.rand(50, generator=g) < 0.9).double()
    corrupted = [(torch.rand(50, generator=g) < p).double() * clean for p in (0.8, 0.5, 0.3)]
    values = torch.stack([clean, *corrupted], dim=1)
    ones = torch.ones(1, 50, dtype=torch.float64)
    by_hand = sum(float(c.mean() / clean.mean()) for c in corrupted) / 3
    assert float(relative_statistic(ones, values)[0]) == pytest.approx(by_hand)
    w, idx = bootstrap_weights(50, 4, seed=2), idx_of(50, 4, seed=2)
    for r in range(4):  # a resample: every accuracy, clean ones included, on the images it drew
        drawn = values[idx[r]]
        expect = sum(float(drawn[:, j].mean() / drawn[:, 0].mean()) for j in (1, 2, 3)) / 3
        assert float(relative_statistic(w[r:r + 1], values)[0]) == pytest.approx(expect)
    m = bootstrap_interval(values, relative_statistic, resamples=300)
    assert m["low"] < m["value"] < m["high"]
