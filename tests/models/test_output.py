"""ModelOutput: the typed structure models return; indexing by a field it lacks names the fields it has."""

from __future__ import annotations

import pytest
import torch

from sslkit.methods.moco import build_moco
from sslkit.models.heads import MLPHead
from sslkit.models.output import ModelOutput


def test_fields_index_and_membership() -> None:
    z = [torch.zeros(2, 3)]
    out = ModelOutput(features=z, projections=z, targets=z)
    assert out["targets"] is z and "targets" in out and "scores" not in out and "nonsense" not in out
    assert out.given() == ["features", "projections", "targets"]
    with pytest.raises(KeyError, match="has no 'predictions'; it has features, projections, targets"):
        out["predictions"]
    with pytest.raises(KeyError, match="has no 'keys'"):  # the old MoCo name is not a silent alias
        out["keys"]
    out["scores"] = z  # a hook may replace a field by name, not invent one
    assert out.scores is z
    with pytest.raises(KeyError, match="no field 'logits'"):
        out["logits"] = z


def test_a_method_model_returns_it() -> None:
    class Trunk(torch.nn.Module):
        out_dim = 6

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    out = build_moco(Trunk(), MLPHead(6, 8, 4))([torch.randn(8, 4), torch.randn(8, 4)])
    assert isinstance(out, ModelOutput) and out.given() == ["features", "projections", "targets"]
