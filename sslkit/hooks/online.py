"""Online monitors during training: RankMe of the embeddings and an online linear probe on detached trunk features."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.distributed import all_reduce_sum, get_world_size
from sslkit.hooks.base import Slot, SSLHook
from sslkit.hooks.logging import MetricsSink
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["OnlineMonitorHook", "rankme"]

logger = logging.getLogger("sslkit")


def rankme(z: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """RankMe (Garrido et al. 2023, "RankMe: Assessing the downstream performance of pretrained self-supervised
    representations by their rank", eq. 1): the effective rank ``exp(-sum_k p_k log p_k)`` of ``z`` [N, D], with
    ``p_k = s_k / sum(s) + eps`` over its singular values ``s``. Between 1 (every embedding on one line, a collapse)
    and ``min(N, D)`` (all directions used equally). Computed in float32 on ``z``'s device."""
    s = torch.linalg.svdvals(z.detach().float())
    p = s / s.sum().clamp_min(torch.finfo(torch.float32).tiny) + eps
    return torch.exp(-(p * torch.log(p)).sum())


@register_hook("online_monitors")
class OnlineMonitorHook(SSLHook):
    """Collapse and quality signals while training, none of which changes the training itself.

    * **RankMe** of the trunk features and of the projections (``rankme_features``, ``rankme_projections``) over
      the last ``rankme_samples`` embeddings of the first view this process saw (a ring buffer on the device),
      computed at the log interval (where the log hook reads the device anyway) and logged with the loss.
    * **Online linear probe** (as solo-learn's): a zero-initialised ``nn.Linear(feature_dim, num_classes)`` trained
      with its own SGD on the detached trunk features of the first view and the batch's labels at every step,
      float32 outside autocast, its gradients averaged over processes. Its running train top-1 of the epoch and,
      with ``test_loader``, its test top-1 (the trunk in eval mode) are written per epoch as
      ``online_linear_top1`` and ``online_linear_test_top1``. No gradient reaches the trunk; the probe uses no
      random numbers, so the training's losses are bit-identical with and without it. Its weights, optimizer
      and counters are checkpointed.
    """

    name = "online_monitors"
    slot = Slot.MONITOR

    def __init__(self, feature_dim: int, num_classes: int = 0, device: torch.device | str = "cpu",
                 every_n_steps: int = 50, rankme_samples: int = 2048, linear: bool = True, linear_lr: float = 0.1,
                 test_loader: Iterable[dict[str, Any]] | None = None, sinks: list[MetricsSink] | None = None,
                 amp_dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device)
        self.every_n_steps = max(1, int(every_n_steps))
        self.rankme_samples = int(rankme_samples)
        self.sinks = sinks or []
        self.test_loader = test_loader
        self.amp_dtype = amp_dtype
        self._buffers: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}
        self._warned = False
        self.probe: nn.Linear | None = None
        if linear and num_classes > 0:
            self.probe = nn.Linear(feature_dim, num_classes, device=self.device, dtype=torch.float32)
            nn.init.zeros_(self.probe.weight)
            nn.init.zeros_(self.probe.bias)
            self.optimizer = torch.optim.SGD(self.probe.parameters(), lr=linear_lr, momentum=0.9)
        elif linear:
            logger.info("online linear probe off: the training data has no labels")
        self.correct = torch.zeros((), dtype=torch.long, device=self.device)
        self.seen = torch.zeros((), dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------------------------------------

    def _remember(self, key: str, z: torch.Tensor) -> None:
        """Put the rows of ``z`` into ``key``'s ring buffer (made at the first call, on ``z``'s device)."""
        z = z.detach().float().reshape(z.shape[0], -1)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[1] != z.shape[1]:
            buf = self._buffers[key] = torch.zeros(self.rankme_samples, z.shape[1], device=z.device)
            self._filled[key] = 0
        n = min(z.shape[0], self.rankme_samples)
        start = self._filled[key] % self.rankme_samples
        idx = (torch.arange(n, device=z.device) + start) % self.rankme_samples
        buf.index_copy_(0, idx, z[:n])
        self._filled[key] += n

    def on_forward(self, task: SSLTask) -> None:
        """Remember this step's embeddings, train the probe on them, and at the log interval measure RankMe."""
        if not task.train or task.last_batch is None:
            return
        out = task.last_batch.model_output
        try:
            feats = out["features"][0]
        except (KeyError, TypeError, IndexError):
            if not self._warned:
                logger.warning("online monitors: the model's output has no 'features'; RankMe and the probe are off")
                self._warned = True
            return
        self._remember("features", feats)
        try:
            proj = out["projections"][0]
            self._remember("projections", proj)
        except (KeyError, TypeError, IndexError):
            pass
        if self.probe is not None:
            self._train_probe(feats, task.last_batch.sample["target"])
        if (task.clock.step + 1) % self.every_n_steps == 0:
            for key, buf in self._buffers.items():
                rows = min(self._filled[key], self.rankme_samples)
                if rows >= 2:
                    task.last_batch.metrics[f"rankme_{key}"] = rankme(buf[:rows])

    def _train_probe(self, feats: torch.Tensor, target: torch.Tensor) -> None:
        assert self.probe is not None
        with torch.autocast(self.device.type, enabled=False), torch.enable_grad():
            x = feats.detach().float().reshape(feats.shape[0], -1)
            y = target.to(self.device, non_blocking=True).long()
            logits = self.probe(x)
            loss = F.cross_entropy(logits, y, ignore_index=-1)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if get_world_size() > 1:
                for p in self.probe.parameters():
                    assert p.grad is not None
                    p.grad.copy_(all_reduce_sum(p.grad) / get_world_size())
            self.optimizer.step()
        labelled = y >= 0
        self.correct += ((logits.detach().argmax(dim=1) == y) & labelled).sum()
        self.seen += labelled.sum()

    @torch.no_grad()
    def _test_top1(self, task: SSLTask) -> float | None:
        from sslkit.evaluation import extract_features
        from sslkit.evaluation.linear import accuracy

        assert self.probe is not None and self.test_loader is not None
        feats, labels = extract_features(task.base_model.trunk, self.test_loader, task.device, self.amp_dtype,
                                         normalize=False)
        if feats.shape[0] == 0:
            return None
        return accuracy(self.probe, feats.to(self.device), labels.to(self.device), self.probe.out_features)["top1"]

    def on_phase_end(self, task: SSLTask) -> None:
        """The probe's train top-1 of the epoch (and its test top-1) to the sinks; the counters start again."""
        if self.probe is None or not task.train:
            return
        correct, seen = (all_reduce_sum(torch.stack([self.correct, self.seen])).tolist() if get_world_size() > 1
                         else (self.correct.item(), self.seen.item()))
        record: dict[str, Any] = {"step": task.clock.step, "epoch": task.epoch, "phase": "eval"}
        if seen:
            record["online_linear_top1"] = correct / seen
        if self.test_loader is not None:
            test = self._test_top1(task)
            if test is not None:
                record["online_linear_test_top1"] = test
        self.correct.zero_()
        self.seen.zero_()
        if len(record) > 3:
            logger.info("online linear probe, epoch %d: %s", task.epoch,
                        ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("online")))
            for sink in self.sinks:
                sink.write(record)

    # ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The probe, its optimizer and the epoch's counters (the RankMe buffers are a window, not state)."""
        if self.probe is None:
            return {}
        return {"probe": self.probe.state_dict(), "optimizer": self.optimizer.state_dict(),
                "correct": self.correct.detach().cpu(), "seen": self.seen.detach().cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` onto the probe's device."""
        if self.probe is None or not state:
            return
        self.probe.load_state_dict(state["probe"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.correct.copy_(state["correct"].to(self.device))
        self.seen.copy_(state["seen"].to(self.device))
