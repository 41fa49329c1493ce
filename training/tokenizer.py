"""Train a byte-level BPE tokenizer on the corpus and save it like Qwen's tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"

# The embedded pair is a Python code model with no chat tokens, so a conversation is rendered as
# code: system and user turns become comment lines, assistant turns stay code, and the generation
# prompt is the start of the next line. HF's Jinja conventions (messages, add_generation_prompt),
# rendered in the server's sandbox (cluster/chat.py).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}\n"
    "{% else %}{% for line in message['content'].split('\n') %}"
    "{{ ('# ' + line).rstrip() }}\n"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path) -> Tokenizer:
    """Train BPE on ``texts``; writes tokenizer.json and tokenizer_config.json into ``out_dir``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"eos_token": END_OF_TEXT, "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer
