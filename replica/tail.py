"""The DSpine tail: candidates, last-write conditional tables, serial chain.

After the parallel draft forward, each of the BS-1 proposal rows holds a
final-normed hidden state whose last bridge write used a *predicted*
predecessor code. The tail refines only that last write with discrete tokens:

1. **candidates** per proposal row: the K (16) best tokens of the shared LM
   head for the row's hidden state. Fast path (``RetrievalMode.FP8``): score
   all V with the row-scaled FP8 head copy, keep R (128), rescore those with
   the real head, keep K (``dspine.kernels.fp8_head_topk``; it can miss a
   token whose FP8 score falls outside the R, see that module). Fallback:
   the real head directly (``head_topk_exact``).
2. **tables**: per row t a K x K table, predecessor candidate j (its code from
   the codebook; row 1's predecessor is the anchor token) x receiver candidate
   i, ``head_i . RMSNorm_g(x_t + r_t W m_t(j))``, through the per-token tables
   of :class:`TailTables` and a per-j norm (``dspine.kernels.tail_tables``);
   no Transformer layer is rerun.
3. **chain** (``dspine.kernels.tail_chain``): one launch for the batch, serial
   over rows. Greedy requests walk the argmax; sampled requests draw from the
   conditional distribution over the K candidates after their own
   temperature / top-k / top-p (float64, ``sampling.probabilities``
   semantics) with uniforms from their own ``torch.Generator``; the q of every
   drawn row is returned for verification, zero outside the candidates.

Resident memory of :class:`TailTables` (27B, BF16 tables): ``token_head_write``
[V, M] 242.5 MiB + ``token_gate_value`` [V, 2M] 485 MiB (727.5 MiB together,
as in the article) + ``write_gram`` [M, M] fp32 1 MiB; with FP8 retrieval also
``head_fp8`` [V, H] e4m3 1.18 GiB + ``head_scale`` [V] fp32 0.95 MiB. The
head, codebook and bridge parameters are referenced, not copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspine import faults
from dspine.kernels import (fp8_head_topk, head_topk_bf16, head_topk_exact, precompute_tail_tables, quantize_head_fp8,
                            tail_chain)
from dspine.kernels import tail_tables as _tail_tables_op
from dspine.kernels.tail_chain import predecessor_slots

from .types import RetrievalMode

__all__ = ["TailTables", "Proposal", "propose", "retrieve_candidates", "conditional_tables", "draw_chain_uniforms",
           "chain_confidence", "verify_lengths"]


@dataclass(frozen=True)
class TailTables:
    """Everything the tail reads, precomputed once per drafter (see the module docstring for memory)."""

    token_head_write: torch.Tensor  # [V, M] W^T (g * head_v), W = last layer's write_proj
    token_gate_value: torch.Tensor  # [V, 2M] [Gp c_v | A c_v], c_v = sqrt(D) codebook[v]
    write_gram: torch.Tensor  # [M, M] fp32 W^T W (the per-j norm)
    head: torch.Tensor  # [V, H] the shared LM head (reference)
    final_norm_weight: torch.Tensor  # [H] g of the final RMSNorm (reference)
    gate_recv: torch.Tensor  # [M, D] G (reference)
    gate_bias: torch.Tensor  # [M] b (reference)
    write_proj: torch.Tensor  # [H, M] W of the last layer (reference)
    head_fp8: torch.Tensor | None  # [V, H] row-scaled e4m3 copy (RetrievalMode.FP8 only)
    head_scale: torch.Tensor | None  # [V] fp32
    norm_eps: float  # eps of the final RMSNorm: y / sqrt(mean(y^2) + eps) * g
    head_topk: int = 16  # K
    num_retrieve: int = 128  # R
    retrieval: RetrievalMode = RetrievalMode.FP8  # how retrieve_candidates scans the head
    head_bf16: torch.Tensor | None = None  # [V, H] bf16 copy (RetrievalMode.BF16 only)

    @classmethod
    def build(cls, *, codebook, gate_recv, gate_pred, value_proj, gate_bias, write_proj, head, final_norm_weight,
              norm_eps: float, head_topk: int = 16, num_retrieve: int = 128,
              retrieval: RetrievalMode | str = RetrievalMode.FP8,
              table_dtype: torch.dtype | None = None) -> "TailTables":
        """Build from plain tensors (``write_proj`` is the LAST layer's ``[H, M]``); ``retrieval``
        decides which copy of the head is made (an FP8 one, a bf16 one, or none for exact)."""
        v = head.shape[0]
        retrieval = RetrievalMode(retrieval)
        if not 1 <= head_topk <= min(num_retrieve, v):
            raise ValueError(f"head_topk: need 1 <= head_topk ({head_topk}) <= min(num_retrieve, V) "
                             f"({min(num_retrieve, v)})")
        with torch.no_grad():
            thw, tgv, gram = precompute_tail_tables(codebook, gate_pred, value_proj, write_proj, head,
                                                    final_norm_weight, dtype=table_dtype)
            fp8 = retrieval == RetrievalMode.FP8
            head_fp8, head_scale = quantize_head_fp8(head) if fp8 else (None, None)
            head_bf16 = head.detach().to(torch.bfloat16).contiguous() if retrieval == RetrievalMode.BF16 else None
        return cls(thw, tgv, gram, head, final_norm_weight, gate_recv, gate_bias, write_proj, head_fp8, head_scale,
                   float(norm_eps), int(head_topk), int(num_retrieve), retrieval, head_bf16)

    @classmethod
    def from_drafter(cls, drafter, **kwargs) -> "TailTables":
        """Build from a ``DSpineDrafter`` (contract attribute names); kwargs as in :meth:`build`."""
        br, args = drafter.bridge, drafter.args
        kw = dict(head_topk=args.head_topk, num_retrieve=args.num_retrieve, norm_eps=args.norm_eps)
        kw.update(kwargs)
        return cls.build(codebook=br.codebook, gate_recv=br.gate_recv, gate_pred=br.gate_pred,
                         value_proj=br.value_proj, gate_bias=br.gate_bias, write_proj=br.write_proj[-1],
                         head=drafter.lm_head_weight, final_norm_weight=drafter.norm.weight, **kw)

    def nbytes(self) -> dict[str, int]:
        """Bytes this object owns (referenced model tensors excluded)."""
        own = {"token_head_write": self.token_head_write, "token_gate_value": self.token_gate_value,
               "write_gram": self.write_gram, "head_fp8": self.head_fp8, "head_scale": self.head_scale,
               "head_bf16": self.head_bf16}
        return {k: (t.numel() * t.element_size() if t is not None else 0) for k, t in own.items()}


@dataclass
class Proposal:
    """The tail's output for NB blocks (one per request)."""

    draft_ids: torch.Tensor  # [NB, BS-1] int64 proposed tokens y_1..y_{BS-1}
    q: torch.Tensor  # [NB, BS-1, K] float64 distribution each y_t was drawn from, over cand_ids[:, t]
    # [NB, BS-1, K] int64 candidates (distinct per row, logit-descending; a merged proposal of two
    # drafters pads a narrower K with copies of the row's first candidate whose q is 0)
    cand_ids: torch.Tensor
    choice: torch.Tensor  # [NB, BS-1] int64 slot of y_t in cand_ids (draft_ids = cand_ids[choice])
    # [NB, BS-1] float: how sure the drafter is at row t BEFORE drawing y_t: the top probability of
    # the softmax (temperature 1) over the K candidates' conditional scores given y_{t-1}. Dynamic
    # verification reads it. None: unknown.
    confidence: torch.Tensor | None = None

    def dense_q(self, vocab_size: int) -> torch.Tensor:
        """q scattered over the vocabulary: ``[NB, BS-1, V]`` float64, zero outside the candidates."""
        out = self.q.new_zeros(*self.q.shape[:2], vocab_size)
        # add, not write: a merged proposal pads its narrower rows with repeated ids of q = 0
        return out.scatter_add_(2, self.cand_ids, self.q)

    @classmethod
    def make_dummy(cls, nb: int = 1, bs: int = 16, k: int = 16) -> "Proposal":
        cand = torch.arange(k).expand(nb, bs - 1, k).contiguous()
        q = torch.zeros(nb, bs - 1, k, dtype=torch.float64)
        q[..., 0] = 1.0
        zeros = torch.zeros(nb, bs - 1, dtype=torch.int64)
        return cls(zeros.clone(), q, cand, zeros)


def retrieve_candidates(hidden: torch.Tensor, tables: TailTables, retrieval: RetrievalMode | str | None = None):
    """``hidden [N, H]`` (final-normed) -> ``(cand_ids [N, K] int64, cand_logits [N, K] fp32)``.
    ``retrieval`` overrides the tables' mode (None: theirs); the head copy it scans must exist."""
    mode = tables.retrieval if retrieval is None else RetrievalMode(retrieval)
    if mode == RetrievalMode.FP8:
        if tables.head_fp8 is None:
            raise ValueError(f"retrieval: fp8 needs the FP8 head copy; these tables were built for {tables.retrieval.value}")
        return fp8_head_topk(hidden, tables.head_fp8, tables.head_scale, tables.head, tables.num_retrieve,
                             tables.head_topk)
    if mode == RetrievalMode.BF16:
        if tables.head_bf16 is None:
            raise ValueError(f"retrieval: bf16 needs the bf16 head copy; these tables were built for {tables.retrieval.value}")
        return head_topk_bf16(hidden, tables.head_bf16, tables.head_topk)
    return head_topk_exact(hidden, tables.head, tables.head_topk)


def conditional_tables(draft_out, tables: TailTables, anchor_ids: torch.Tensor, cand_ids: torch.Tensor):
    """``scores [NB, BS-1, K (pred j), K (recv i)]``; row 1's predecessors are all the anchor."""
    nb, _, k = cand_ids.shape
    pred_ids = torch.cat([anchor_ids.to(cand_ids.dtype).view(nb, 1, 1).expand(nb, 1, k), cand_ids[:, :-1]], dim=1)
    return _tail_tables_op(draft_out.x_last, draft_out.rms, draft_out.codes, cand_ids, pred_ids.contiguous(),
                           tables.gate_recv, tables.gate_bias, tables.token_gate_value, tables.token_head_write,
                           tables.write_gram, tables.write_proj, tables.head, tables.final_norm_weight,
                           tables.norm_eps)


def draw_chain_uniforms(generators: Sequence[torch.Generator | None] | None, temperature: torch.Tensor, n: int,
                        device, num_coins: int | None = None) -> torch.Tensor:
    """``[NB, n]`` float64 coins: row b from ``generators[b]`` for sampled requests, zeros for greedy ones.

    Greedy requests consume nothing from their generator; a ``None`` generator
    (or ``generators=None``) uses torch's default generator. ``num_coins`` (>= n) coins are drawn
    per sampled row and the first n returned: a short block consumes a whole block's coins.
    """
    if num_coins is not None and num_coins > n:
        return draw_chain_uniforms(generators, temperature, num_coins, device)[:, :n]
    temps = temperature.tolist()
    gens = list(generators) if generators is not None else [None] * len(temps)
    if len(gens) != len(temps):
        raise ValueError(f"generators: expected {len(temps)} (one per block), got {len(gens)}")
    rows = []
    for t, g in zip(temps, gens):
        if t <= 0:
            rows.append(torch.zeros(n, dtype=torch.float64, device=device))
        elif g is None:
            rows.append(torch.rand(n, dtype=torch.float64, device=device))
        else:
            rows.append(torch.rand(n, generator=g, dtype=torch.float64, device=g.device).to(device))
    return torch.stack(rows) if rows else torch.zeros(0, n, dtype=torch.float64, device=device)


@torch.no_grad()
def propose(draft_out, tables: TailTables, anchor_ids: torch.Tensor, temperature: torch.Tensor,
            top_k: torch.Tensor, top_p: torch.Tensor, generators: Sequence[torch.Generator | None] | None = None,
            *, uniforms: torch.Tensor | None = None, retrieval: RetrievalMode | str | None = None,
            with_confidence: bool = True, num_coins: int | None = None) -> Proposal:
    """Run the tail for NB blocks.

    ``draft_out``: anything with ``hidden [NB, BS, H]`` (final-normed), ``x_last
    [NB, BS, H]`` (last layer's residual before its bridge write), ``rms [NB, BS]``
    and ``codes [NB, BS, D]`` of the last bridge (``DSpineDrafter.draft``'s
    ``DraftOut``). ``anchor_ids [NB]``; ``temperature [NB]`` (0 = greedy),
    ``top_k [NB]`` (0 = off), ``top_p [NB]`` (1 = off), e.g. from
    ``sampling.batch_params``; ``generators``: one per block (``None`` entries use
    the default RNG). ``uniforms [NB, BS-1]`` overrides the generators (tests,
    or an engine that pre-draws all coins of a cycle). ``with_confidence=False`` skips
    ``chain_confidence`` (an engine that verifies whole blocks never reads it).
    ``num_coins`` (>= BS-1) coins are drawn per sampled block and the first BS-1 used: a block
    shorter than the drafter's consumes a whole block's coins from its generator all the same.
    """
    hidden = draft_out.hidden
    nb, bs, h = hidden.shape
    if anchor_ids.shape != (nb,):
        raise ValueError(f"anchor_ids: expected shape [{nb}], got {list(anchor_ids.shape)}")
    dev = hidden.device
    cand_ids, _ = retrieve_candidates(hidden[:, 1:].reshape(nb * (bs - 1), h), tables, retrieval)
    cand_ids = cand_ids.view(nb, bs - 1, -1)
    scores = conditional_tables(draft_out, tables, anchor_ids.to(dev), cand_ids)
    temperature = temperature.to(device=dev, dtype=torch.float64)
    if uniforms is None:
        uniforms = draw_chain_uniforms(generators, temperature, bs - 1, dev, num_coins)
    draft_ids, choice, q = tail_chain(scores, cand_ids, temperature, top_k.to(device=dev, dtype=torch.int64),
                                      top_p.to(device=dev, dtype=torch.float64), uniforms.to(dev))
    confidence = chain_confidence(scores, choice) if with_confidence else None
    return Proposal(draft_ids, q, cand_ids, choice, confidence)


def chain_confidence(scores: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """``[NB, BS-1]`` fp32: row t's top probability (softmax over the K receivers, temperature 1)
    given the chosen predecessor y_{t-1} (row 1: the anchor). scores [NB, BS-1, K, K]; choice [NB, BS-1].

    It deliberately does not look at the token drawn at row t: whether row t is verified may depend
    on y_1 .. y_{t-1}, but never on y_t itself, or sampled verification would stop being lossless
    (dropping unlikely draws in favour of a fresh target draw biases the output). For greedy rows
    the top probability is that of y_t anyway."""
    nb, rows, k, _ = scores.shape
    pred = predecessor_slots(choice)
    table = scores.gather(2, pred[:, :, None, None].expand(nb, rows, 1, k)).squeeze(2)  # [NB, BS-1, K]
    if faults.active("tail.confidence_reads_own_draw"):
        return table.float().softmax(-1).gather(2, choice[:, :, None]).squeeze(2)
    return table.float().softmax(-1).amax(-1)


def verify_lengths(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Dynamic verification: ``[NB]`` int64, how many leading draft tokens each request verifies.

    Row t is kept while the product of the drafter's confidences of rows 1..t (see
    ``chain_confidence``: none of them looks at the token drawn at its own row) is at least
    ``threshold``; 0 keeps the whole block. Verification stays lossless, and a shorter verify
    forward is cheaper (fewer GEMM rows), while a row that is unlikely to be reached and accepted
    adds little."""
    # confidence: [NB, BS-1]
    if threshold <= 0:
        return torch.full(confidence.shape[:1], confidence.shape[1], dtype=torch.int64, device=confidence.device)
    return (confidence.double().cumprod(dim=1) >= threshold).sum(dim=1)
