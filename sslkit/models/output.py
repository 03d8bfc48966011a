"""ModelOutput: what every model's forward returns, the one structure losses and hooks read."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["ModelOutput"]


@dataclass
class ModelOutput:
    """The outputs of an SSL model for one batch, one tensor per view in the order of the views.

    * ``features``: trunk features (what kNN, linear probes and feature export read);
    * ``projections``: head outputs of the student (SwAV: L2-normalised embeddings; DINO: logits);
    * ``predictions``: predictor outputs (BYOL, SimSiam, MoCo v3), paired with ``targets``;
    * ``targets``: what the student's outputs are compared with, without gradient, paired by index:
      the other view's target projection (BYOL, SimSiam), the positive key (MoCo v2, MoCo v3), the
      teacher's logits of the global crops (DINO);
    * ``scores``: prototype scores (SwAV);
    * ``prototypes``: the prototype matrix, detached (SwAV);
    * ``tokens``: per view, a ViT trunk's output tokens (:class:`~sslkit.models.tokens.Tokens`: CLS, registers,
      patches), so dense and masked methods read patch features without hooks into the trunk; None for CNNs;
    * ``masks``: per view, the :class:`~sslkit.models.masking.Masks` the model applied (None for a view left whole):
      which patches a masked loss is computed on;
    * ``patch_projections``, ``patch_targets``, ``patch_weights``: the student's and the teacher's patch-head
      logits at fixed slots, and the slots' weights (1 on a masked patch, 0 on padding): iBOT's and DINOv2's
      masked-patch loss. Per masked view ``[B, M, K]`` and ``[B, M]`` (``M`` slots per image), or, with
      ``patch_images``, ``[S, K]`` and ``[S]`` for a whole batch of images in one buffer, ``patch_images`` ``[S]``
      giving each slot's image (:class:`~sslkit.methods.ibot.IBOTModel`);
    * ``gram_patches``, ``gram_targets``, ``gram_masks``: DINOv3's Gram anchoring: the student's patch tokens of
      the (masked) global crops ``[G B, N, D]``, the Gram teacher's of the same crops brought to the student's grid
      (no gradient), and ``[G B, N]`` True where the student saw the mask token
      (:class:`~sslkit.methods.dinov3.DINOv3Model`, from the update the Gram loss starts at);
    * ``anchor_tokens``, ``anchor_targets``: the anchor to the starting model: the student's CLS ``[G B, D]`` and
      patch tokens ``[G B, N, D]`` of the masked global crops, and a frozen copy of the starting trunk's of the same
      crops and masks (no gradient; :mod:`sslkit.methods.anchor`);
    * ``teacher``, ``students``: distillation's frozen teacher's outputs of the step (computed once) and each
      student's, by name (:class:`~sslkit.methods.distill.DistillModel`).

    Fields a method does not produce are None. A loss or hook may index it by field name
    (``output["projections"]``, as a plain dict of the same keys would be, and a hook may replace a
    field that way); asking for a field the model did not give is a ``KeyError`` that names the
    fields it did.
    """

    features: list[torch.Tensor]
    projections: list[torch.Tensor]
    predictions: list[torch.Tensor] | None = None
    targets: list[torch.Tensor] | None = None
    scores: list[torch.Tensor] | None = None
    prototypes: torch.Tensor | None = None
    tokens: list[Any] | None = None
    masks: list[Any] | None = None
    patch_projections: list[torch.Tensor] | None = None
    patch_targets: list[torch.Tensor] | None = None
    patch_weights: list[torch.Tensor] | None = None
    patch_images: list[torch.Tensor] | None = None
    gram_patches: torch.Tensor | None = None
    gram_targets: torch.Tensor | None = None
    gram_masks: torch.Tensor | None = None
    anchor_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    anchor_targets: tuple[torch.Tensor, torch.Tensor] | None = None
    teacher: Any = None
    students: dict[str, Any] | None = None

    def given(self) -> list[str]:
        """The fields this output holds (not None)."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key, None) if key in _FIELDS else None
        if value is None:
            raise KeyError(f"the model's output has no '{key}'; it has {', '.join(self.given())} "
                           "(a loss or hook that needs it does not fit this model: see docs/methods.md)")
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _FIELDS:
            raise KeyError(f"a model output has no field '{key}'; its fields are {', '.join(sorted(_FIELDS))}")
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in _FIELDS and getattr(self, key) is not None


_FIELDS = frozenset(f.name for f in fields(ModelOutput))
