"""What each block row is trained toward: the target's greedy token and, opt-in, its top-k distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def block_labels(tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """Labels of the blocks at ``anchors [B, A]`` -> ``(labels, preds, valid)``, each [B, A, BS-1].

    Row k (1..BS-1) of anchor a is labelled with the target's greedy token after x[..a+k-1],
    ``greedy[a+k-1]``; its true predecessor is ``preds = x[a+k-1]`` (row 1: the anchor). The label is
    the target's greedy CONTINUATION from the anchor only while the sequence itself follows the
    target's greedy path (x[a+j] == greedy[a+j-1] for 1 <= j < k): always inside a generated
    continuation; in prompt text until the text first departs from the target's choice (that row
    still counts, its label is the target's token). ``valid`` marks those rows."""
    idx = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)  # a .. a+BS-2
    preds = tokens.gather(1, idx.flatten(1)).view_as(idx)
    labels = greedy.gather(1, idx.flatten(1)).view_as(idx)
    agree = preds[:, :, 1:] == labels[:, :, :-1]  # x[a+j] == greedy[a+j-1], j = 1..BS-2
    valid = torch.cat([torch.ones_like(agree[:, :, :1]), agree.int().cumprod(-1).bool()], dim=-1)
    return labels, preds, valid



@dataclass
class SoftLabels:
    """The target's top-k next-token distribution after every prefix of every sequence."""

    ids: torch.Tensor  # [N, L, k] int32
    logp: torch.Tensor  # [N, L, k] bf16 log-probabilities (of the full softmax)

    @classmethod
    def empty(cls, n: int, length: int, k: int) -> "SoftLabels":
        return cls(torch.empty(n, length, k, dtype=torch.int32), torch.empty(n, length, k, dtype=torch.bfloat16))

    def __getitem__(self, index) -> "SoftLabels":
        return SoftLabels(self.ids[index], self.logp[index])

    def at_blocks(self, anchors: torch.Tensor, block_size: int,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row k of the block at anchor a reads position a+k-1: ``(ids [B, A, BS-1, k] int64,
        probs [B, A, BS-1, k] fp32 renormalised over the k)`` at ``temperature`` (exact on the top k:
        softmax(logits / T) restricted to them is softmax(logp / T) renormalised). anchors [B, A]."""
        idx = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)  # [B, A, BS-1]
        k = self.ids.shape[-1]
        flat = idx.flatten(1)[..., None].expand(-1, -1, k)
        ids = self.ids.gather(1, flat).view(*idx.shape, k).long()
        probs = (self.logp.gather(1, flat).view(*idx.shape, k).float() / temperature).softmax(-1)
        return ids, probs

