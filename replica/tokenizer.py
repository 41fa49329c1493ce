"""Tokenizer of a model directory: `tokenizers.Tokenizer` from tokenizer.json, plus special ids.

- eos ids: union (in order) of tokenizer_config.json `eos_token`,
  generation_config.json and config.json `eos_token_id` (int or list).
- bos id and `chat_template` from tokenizer_config.json when present
  (the template string is exposed; rendering it is the caller's business).
- `vocab_size` is the tokenizer's (with added tokens); the model's embedding
  may be larger (padded).
"""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from dspine import faults

_RELEASE_GIL_FROM = 2048  # characters (encode) or ids (decode); below it a call holds the GIL ~2 ms at most


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids=(), bos_token_id: int | None = None,
                 chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tok = tokenizers.Tokenizer.from_file(str(file))
        cfg = cls._read_json(path / "tokenizer_config.json")
        eos: list[int] = []
        bos = None
        name = _token_content(cfg.get("eos_token"))
        if name is not None:
            tid = tok.token_to_id(name)
            if tid is None:
                raise ValueError(f"tokenizer_config.json eos_token {name!r} is not in tokenizer.json")
            eos.append(tid)
        name = _token_content(cfg.get("bos_token"))
        if name is not None:
            bos = tok.token_to_id(name)
        for extra in ("generation_config.json", "config.json"):
            data = cls._read_json(path / extra)
            data = data.get("text_config", data) if "eos_token_id" not in data else data
            eos += _as_ids(data.get("eos_token_id"))
        return cls(tok, eos, bos, cfg.get("chat_template"))

    @staticmethod
    def _read_json(file: Path) -> dict:
        return json.loads(file.read_text()) if file.exists() else {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # Long inputs go through the batch calls, with one input, because `tokenizers` releases the GIL
    # only in them: a plain `encode` of a 1,000,000-character text holds it for about a second,
    # which stalls the server's event loop and the engine's thread, whatever thread it runs in.
    # Short ones (every per-step detokenization) keep the plain call: it is a few microseconds faster.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a long text is encoded with the GIL released)."""
        if len(text) < _RELEASE_GIL_FROM or faults.active("tokenizer.encode_holds_gil"):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (many ids are decoded with the GIL released)."""
        ids = list(map(int, ids))  # a comprehension was a third of a step's detokenization
        if len(ids) < _RELEASE_GIL_FROM:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (its raw text, special tokens included), or None."""
        return self.tokenizer.id_to_token(int(token_id))

    @property
    def bos_token(self) -> str | None:
        """Text of the beginning-of-sequence token (what a chat template calls ``bos_token``), or None."""
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        """Text of the first end-of-sequence token (a chat template's ``eos_token``), or None."""
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
