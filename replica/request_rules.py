"""The request rules that both the engine and the gRPC edge enforce, in one place.

Torch-free on purpose: the edge validates wire requests with these before a
request reaches an engine (and the SDK may import them without loading torch).
Each function returns ``None`` when the value is fine, or the reason it is not
(the caller knows which field it checked and raises its own typed error).
"""

from __future__ import annotations

from typing import Iterable

MAX_SEED = 2**64
"""Seeds are in [0, 2**64): what ``torch.Generator.manual_seed`` takes without wrapping."""


def token_id_problem(token: object, vocab_size: int) -> str | None:
    """Why ``token`` is not an id of a ``vocab_size`` vocabulary, or None (bools are not ids)."""
    if isinstance(token, bool) or not isinstance(token, int):
        return f"{token!r} is not an int token id"
    if not 0 <= token < vocab_size:
        return f"{token} is not a token id in [0, {vocab_size})"
    return None


def token_ids_problem(token_ids: Iterable[object], vocab_size: int) -> tuple[int, str] | None:
    """(index, reason) of the first element that is not a token id, or None."""
    for i, token in enumerate(token_ids):
        problem = token_id_problem(token, vocab_size)
        if problem is not None:
            return i, problem
    return None


def prompt_length_problem(prompt_len: int, max_context: int) -> str | None:
    """Why a ``prompt_len``-token prompt cannot start, or None: it must leave room for one new token."""
    if prompt_len >= max_context:
        return (f"prompt has {prompt_len} tokens; the context limit is {max_context} "
                "(prompt and output together)")
    return None


def seed_problem(seed: int) -> str | None:
    """Why ``seed`` is out of range, or None."""
    if not 0 <= seed < MAX_SEED:
        return f"must be in [0, 2**64), got {seed!r}"
    return None
