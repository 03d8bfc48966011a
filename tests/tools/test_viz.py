"""sslkit viz: the numbers behind each picture (attention, PCA, neighbours, the embedding), the files, the errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RECIPES, SMALL, run_main, run_sslkit
from PIL import Image

from sslkit.tools.pretrained import load_pretrained
from sslkit.tools.viz import (
    LINE,
    cls_attention,
    embed_2d,
    foreground,
    grid_size,
    kept_by_mass,
    nearest,
    patch_features,
    principal_components,
)

TINY = [*SMALL, "optim.max_steps=2", "log.tensorboard=false", "eval.knn.enabled=false"]
#: A ViT of 2 blocks, 2 heads and one register token on 4 x 4 patches of the synthetic 32 px images.
TINY_VIT = [*TINY, *RECIPES["simclr_vit"], "model.trunk_kwargs.reg_tokens=1", "data.test.kwargs={num_samples: 48}"]

sslkit = run_sslkit


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("viz") / "vit"
    run_main("config=simclr_vit", *TINY_VIT, f"output_dir={out}")
    return out


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("viz") / "cnn"
    run_main("config=simclr", *TINY, "data.test.kwargs={num_samples: 48}", f"output_dir={out}")
    return out


def _png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


def _extract(run: Path, split: str, out: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kNN tool's features of a split (sslkit extract), raw."""
    code, _, err = sslkit("extract", f"checkpoint={run}", f"split={split}", f"output={out}")
    assert code == 0, err
    data = np.load(out)
    return data["features"], data["labels"], data["indices"]


# ---------------------------------------------------------------------------------------------
# The numbers
# ---------------------------------------------------------------------------------------------


def test_attention_weights_are_the_ones_the_last_block_uses(vit_run: Path) -> None:
    """Each row is a softmax (sums to one), and the weights times the block's values, through its projection, give
    exactly what timm's fused attention returned."""
    trunk = load_pretrained(str(vit_run), ["machine.device=cpu"]).trunk
    attn = trunk.blocks[-1].attn
    seen: dict[str, torch.Tensor] = {}
    handles = [attn.register_forward_pre_hook(lambda _m, a: seen.__setitem__("x", a[0])),
               attn.register_forward_hook(lambda _m, _a, out: seen.__setitem__("out", out))]
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    weights, prefix = cls_attention(trunk, x)
    for h in handles:
        h.remove()
    assert prefix == 2  # the CLS token and one register
    assert weights.shape == (3, 2, 2 + 16, 2 + 16)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(3, 2, 18), atol=1e-6, rtol=0)
    tokens = seen["x"]
    b, t, c = tokens.shape
    v = attn.qkv(tokens).reshape(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)[2]
    mixed = (weights @ v).transpose(1, 2).reshape(b, t, c)
    with torch.no_grad():
        torch.testing.assert_close(attn.proj(attn.norm(mixed)), seen["out"], atol=1e-5, rtol=1e-5)


def test_the_kept_patches_hold_the_mass_by_hand() -> None:
    w = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert kept_by_mass(w, 0.6).tolist() == [[False, True, False, True]]  # 0.5 < 0.6 <= 0.5 + 0.3
    assert kept_by_mass(w, 0.5).tolist() == [[False, True, False, False]]
    assert kept_by_mass(w * 7, 0.6).tolist() == [[False, True, False, True]]  # rows need not sum to one
    assert kept_by_mass(w, 1.0).all()
    assert kept_by_mass(torch.full((1, 4), 0.25), 0.3).all()  # ties at the boundary are all kept
    with pytest.raises(ValueError):
        kept_by_mass(w, 0.0)


def test_principal_components_are_orthonormal_and_those_of_the_covariance() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g) * torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.1]) + 3.0
    mean, comps, ratio = principal_components(x, 3)
    torch.testing.assert_close(comps @ comps.T, torch.eye(3, dtype=torch.float64), atol=1e-10, rtol=0)
    cov = np.cov(x.double().numpy(), rowvar=False)
    values, vectors = np.linalg.eigh(cov)
    order = np.argsort(values)[::-1]
    np.testing.assert_allclose(ratio.numpy(), values[order][:3] / values.sum(), rtol=1e-8)
    for i in range(3):  # the same directions, up to sign
        assert abs(float(np.dot(comps[i].numpy(), vectors[:, order[i]]))) == pytest.approx(1.0, abs=1e-8)
    np.testing.assert_allclose(mean.numpy(), x.double().mean(dim=0).numpy())


def test_the_foreground_is_the_side_away_from_the_edges() -> None:
    scores = torch.tensor([0.0, 0.1, 0.9, 1.0, 0.2])
    edge = torch.tensor([True, True, False, False, True])
    mask, threshold = foreground(scores, edge)
    assert threshold == pytest.approx(0.5) and mask.tolist() == [False, False, True, True, False]
    mask, _ = foreground(-scores, edge)  # the sign of a component is arbitrary: the same split
    assert mask.tolist() == [False, False, True, True, False]


def test_nearest_are_the_top_cosine_similarities() -> None:
    g = torch.Generator().manual_seed(1)
    memory, queries = torch.randn(50, 8, generator=g), torch.randn(4, 8, generator=g)
    sims, idx = nearest(memory, queries, 5)
    cos = torch.nn.functional.cosine_similarity(queries[:, None], memory[None], dim=-1)
    expected = torch.topk(cos, 5, dim=1)
    torch.testing.assert_close(sims, expected.values, atol=1e-6, rtol=0)
    assert idx.tolist() == expected.indices.tolist()


def test_embedding_falls_back_to_pca_and_names_the_method(monkeypatch: pytest.MonkeyPatch) -> None:
    feats = torch.randn(30, 5, generator=torch.Generator().manual_seed(2))
    monkeypatch.setitem(sys.modules, "umap", None)  # not installed
    coords, name = embed_2d(feats, "auto")
    assert name.startswith("PCA") and "umap-learn not installed" in name
    x = torch.nn.functional.normalize(feats.double(), dim=1).numpy()
    x = x - x.mean(axis=0)
    _, _, vh = np.linalg.svd(x, full_matrices=False)
    for i in range(2):
        np.testing.assert_allclose(np.abs(coords[:, i]), np.abs(x @ vh[i]), atol=1e-10)
    from sslkit.tools.pretrained import ToolError

    with pytest.raises(ToolError, match=r"pip install 'sslkit\[viz\]'"):
        embed_2d(feats, "umap")


def test_embedding_uses_umap_when_it_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """With umap-learn importable, auto takes UMAP with the protocol's cosine metric and a seed (a stand-in module:
    umap-learn's compilation costs seconds; the README's picture is from the real one)."""
    made: dict[str, object] = {}

    class FakeUMAP:
        def __init__(self, **kwargs: object) -> None:
            made.update(kwargs)

        def fit_transform(self, x: np.ndarray) -> np.ndarray:
            return x[:, :2] * 2

    monkeypatch.setitem(sys.modules, "umap", types.SimpleNamespace(UMAP=FakeUMAP))
    feats = torch.randn(20, 4, generator=torch.Generator().manual_seed(3))
    coords, name = embed_2d(feats, "auto", seed=7)
    assert name.startswith("UMAP") and made["metric"] == "cosine" and made["random_state"] == 7
    np.testing.assert_allclose(coords, 2 * torch.nn.functional.normalize(feats.double(), dim=1)[:, :2].numpy())


# ---------------------------------------------------------------------------------------------
# The command on trained checkpoints
# ---------------------------------------------------------------------------------------------


def test_viz_of_a_vit_draws_every_kind_with_the_knn_tools_numbers(vit_run: Path, tmp_path: Path) -> None:
    code, _, err = sslkit("viz", f"checkpoint={vit_run}", "n=3", "k=4", "method=pca", "samples=40")
    assert code == 0, err
    viz = vit_run / "viz"
    page = (viz / "index.html").read_text()
    for kind in ("attention", "pca", "embedding", "neighbors"):
        record = json.loads((viz / kind / f"{kind}.json").read_text())
        assert (viz / kind / "index.html").exists()
        for name in record["files"]:
            assert f"{kind}/{name}" in page and (viz / kind / name).exists()
    attention = json.loads((viz / "attention" / "attention.json").read_text())
    cell = attention["cell"]
    assert cell == 96  # 32 px images enlarged three times
    assert _png_size(viz / "attention" / "attention.png") == grid_size(3, 2 + 2, cell, 2)
    assert all(1 <= k <= 16 for r in attention["images"] for k in r["kept_patches"])
    # the CLS token's weights on the patches: the rest went to itself and the register
    assert all(0 < s < 1 for r in attention["images"] for s in r["cls_share_on_patches"])
    pca = json.loads((viz / "pca" / "pca.json").read_text())
    assert _png_size(viz / "pca" / "pca.png") == grid_size(3, 4, cell, 2)
    assert pca["grid"] == [4, 4] and pca["patch_features"] == "patch tokens" and "CNN" not in pca["about"]
    assert pca["explained_variance_ratio"] == sorted(pca["explained_variance_ratio"], reverse=True)
    neighbors = json.loads((viz / "neighbors" / "neighbors.json").read_text())
    assert _png_size(viz / "neighbors" / "neighbors.png") == grid_size(3, 1 + 4, cell, 2)
    # the neighbours are those of the kNN tool's features (sslkit extract), by cosine similarity
    train_f, train_y, _ = _extract(vit_run, "train", tmp_path / "train.npz")
    test_f, test_y, test_i = _extract(vit_run, "test", tmp_path / "test.npz")
    memory = train_f / np.linalg.norm(train_f, axis=1, keepdims=True)
    for q in neighbors["queries"]:
        row = int(np.flatnonzero(test_i == q["index"])[0])
        sims = memory @ (test_f[row] / np.linalg.norm(test_f[row]))
        top = np.argsort(-sims, kind="stable")[:4]
        assert q["neighbours"] == top.tolist()
        np.testing.assert_allclose(q["similarities"], sims[top], atol=1e-5)
        assert q["neighbour_labels"] == train_y[top].tolist() and q["label"] == int(test_y[row])
    embedding = json.loads((viz / "embedding" / "embedding.json").read_text())
    assert _png_size(viz / "embedding" / "embedding.png") == (800, 800)
    assert embedding["method"].startswith("PCA") and embedding["samples"] == 40
    data = np.load(viz / "embedding" / "embedding.npz")
    x = test_f[np.searchsorted(test_i, data["indices"])]
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    x = x - x.mean(axis=0)
    _, _, vh = np.linalg.svd(x, full_matrices=False)
    for i in range(2):
        np.testing.assert_allclose(np.abs(data["coords"][:, i]), np.abs(x @ vh[i]), atol=1e-4)


def test_viz_of_a_cnn_draws_its_feature_map_and_refuses_attention(cnn_run: Path) -> None:
    trunk = load_pretrained(str(cnn_run), ["machine.device=cpu"]).trunk
    x = torch.randn(2, 3, 32, 32)
    maps = patch_features(trunk, x)
    assert maps.shape == (2, 4, 4, 64)  # the small CNN's last map: 64 channels of a 4 x 4 grid
    code, _, err = sslkit("viz", f"checkpoint={cnn_run}", "kind=attention")
    assert code == 2 and "kind=attention needs a ViT" in err and "kind=pca,embedding,neighbors" in err
    assert "Traceback" not in err and not (cnn_run / "viz").exists()
    code, _, err = sslkit("viz", f"checkpoint={cnn_run}", "kind=pca", "n=2", "image_size=64")
    assert code == 0, err
    pca = json.loads((cnn_run / "viz" / "pca" / "pca.json").read_text())
    assert pca["patch_features"] == "last feature map" and pca["grid"] == [8, 8] and pca["cell"] == 128
    assert "A CNN's panels are mostly black" in pca["about"]  # said where the picture is
    assert _png_size(cnn_run / "viz" / "pca" / "pca.png") == grid_size(2, 4, 128, 2)


def _image(path: Path, value: int) -> None:
    Image.fromarray(np.full((40, 36, 3), value, dtype=np.uint8)).save(path)


def test_viz_reads_a_folder_skips_an_unreadable_image_and_says_so(vit_run: Path, tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        _image(folder / f"img{i}.png", 60 * i)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out = tmp_path / "out"
    code, said, err = sslkit("viz", f"checkpoint={vit_run}", f"images={folder}", "kind=attention,pca",
                             f"output={out}", "n=10")
    assert code == 0, err
    assert "skipped an image: cannot read image" in said and "broken.png" in said  # the log is on stdout
    assert "Traceback" not in said + err
    record = json.loads((out / "attention" / "attention.json").read_text())
    assert [r["image"] for r in record["images"]] == ["img0.png", "img1.png", "img2.png"]
    assert _png_size(out / "pca" / "pca.png") == grid_size(3, 4, record["cell"], 2)
    # a file list works the same
    listing = tmp_path / "list.txt"
    listing.write_text("imgs/img2.png\nimgs/img0.png\n")
    code, _, err = sslkit("viz", f"checkpoint={vit_run}", f"images={listing}", "kind=pca", f"output={out}")
    assert code == 0, err
    assert [r["image"] for r in json.loads((out / "pca" / "pca.json").read_text())["images"]] == ["img2.png",
                                                                                                  "img0.png"]


@pytest.mark.parametrize("args, words", [
    (("kind=atention",), "Did you mean 'attention'"),
    (("images=/nonexistent/folder",), "no such file or folder"),
    (("kind=embedding", "images={unlabelled}"), "has no labels"),
    (("kind=pca", "images={broken}"), "none of the 1 images could be read"),
    (("kind=attention", "image_size=30"), "multiples of its patch size, 8"),
    (("mass=1.5", "kind=attention"), "mass=1.5"),
    (("mass=most", "kind=attention"), "mass=most: give the share"),
    (("features=teacher",), "has no teacher"),
    (("n=lots",), "n=lots: give a whole number"),
])
def test_viz_mistakes_are_messages(vit_run: Path, tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    unlabelled = tmp_path / "flat"
    unlabelled.mkdir()
    _image(unlabelled / "a.png", 10)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.jpg").write_bytes(b"not an image")
    out = tmp_path / "out"
    filled = [a.format(unlabelled=unlabelled, broken=broken) for a in args]
    code, _, err = sslkit("viz", f"checkpoint={vit_run}", f"output={out}", *filled)
    assert code == 2 and words in err and "Traceback" not in err, err
    assert not list(out.glob("*/*.png"))


def test_caption_lines_fit_the_grid() -> None:
    assert grid_size(1, 1, 96, 2) == (96 + 8, 96 + 2 * LINE + 8)
