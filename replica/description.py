"""What an engine serves, as plain data: the one face of an engine that the gRPC edge reads.

The edge (validation limits, ``GetModelInfo``, chat rendering) needs the model's
vocabulary, context and block size, whether a drafter is loaded, the EOS ids and
the tokenizer's public face; it must not reach into ``engine.target.args``,
``engine.drafter``, ``engine.config`` or the raw ``tokenizers`` object, which
belong to the engine and change with it. :func:`describe_engine` reads them once,
here, and :func:`resolve_eos_token_ids` is THE rule of which tokens end a
generation (the engine's stop checker and the edge's model info both use it).

Torch-free: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ["EngineDescription", "describe_engine", "resolve_eos_token_ids"]


def resolve_eos_token_ids(tokenizer: "Tokenizer | None", target_args: Any) -> tuple[int, ...]:
    """The token ids that end a generation: the tokenizer's (its config files' union, see
    :class:`~dspine.replica.tokenizer.Tokenizer`) when there is one, else the target config's
    ``eos_token_id``."""
    if tokenizer is not None:
        return tuple(tokenizer.eos_token_ids)
    return tuple(int(t) for t in getattr(target_args, "eos_token_id", ()) or ())


@dataclass(frozen=True)
class EngineDescription:
    """Model info, limits and tokenizer face of one engine (see :func:`describe_engine`)."""

    model_type: str  # the target config's model_type, e.g. "qwen3_5_text"
    vocab_size: int  # valid token ids are [0, vocab_size) (the model's embedding rows)
    max_context: int  # prompt + output tokens (the engine's max_seq_len)
    block_size: int  # the drafter's block (draft tokens + 1); 0 without a drafter
    max_concurrency: int  # requests in flight at most
    has_drafter: bool
    speculative_default: bool  # what a request that leaves `speculative` unset gets
    eos_token_ids: tuple[int, ...]
    tokenizer: "Tokenizer | None" = None  # the project's Tokenizer (encode / decode), or None
    bos_token: str = ""  # text of the BOS token ("" when none), for chat templates
    eos_token: str = ""  # text of the first EOS token ("" when none)
    chat_template: str | None = None  # the tokenizer's Jinja chat template source, or None
    # the drafters loaded, () / ("greedy",) / ("greedy", "sampled") (replica/drafters.py), and the
    # temperature from which a request drafts with the sampled one (None unless two are loaded)
    drafters: tuple[str, ...] = ()
    sampled_draft_min_temperature: float | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(self.chat_template)


def describe_engine(engine) -> EngineDescription:
    """The :class:`EngineDescription` of ``engine`` (an :class:`~dspine.replica.Engine`).

    This is the only place outside the engine that reads its attributes; the
    engine's own ``describe()`` returns the same."""
    args = engine.target.args
    tokenizer = engine.tokenizer
    has_drafter = engine.drafter is not None
    drafters = () if not has_drafter else (
        ("greedy", "sampled") if getattr(engine, "sampled_drafter", None) is not None else ("greedy",))
    return EngineDescription(
        model_type=str(getattr(args, "model_type", "") or ""),
        vocab_size=int(args.vocab_size),
        max_context=int(engine.max_seq_len),
        block_size=int(engine.block_size),
        max_concurrency=int(engine.config.max_concurrency),
        has_drafter=has_drafter,
        speculative_default=has_drafter and bool(engine.config.speculative_default),
        eos_token_ids=resolve_eos_token_ids(tokenizer, args),
        tokenizer=tokenizer,
        bos_token=(getattr(tokenizer, "bos_token", None) or "") if tokenizer is not None else "",
        eos_token=(getattr(tokenizer, "eos_token", None) or "") if tokenizer is not None else "",
        chat_template=getattr(tokenizer, "chat_template", None) if tokenizer is not None else None,
        drafters=drafters,
        sampled_draft_min_temperature=(float(engine.config.sampled_draft_min_temperature)
                                       if len(drafters) == 2 else None),
    )
