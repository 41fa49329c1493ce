"""`Tokenizer.from_dir` on a tiny tokenizer.json built with the `tokenizers` library."""
import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, decoders, trainers

from dspine.replica.tokenizer import Tokenizer


@pytest.fixture()
def tok_dir(tmp_path):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "hello world, hello tokens"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return tmp_path


def test_roundtrip_and_specials(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = "def hello(x):\n    return x + 1  # ünïcode\n"
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids) and tok.decode(ids) == text
    assert tok.eos_token_ids == (1, 0)  # tokenizer_config first, then generation_config, no duplicates
    assert tok.chat_template == "{{ messages }}"
    assert 256 < tok.vocab_size <= 300


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
