"""The benches' prompts: cut from held-out stdlib files (never trained on), or seeded random ids."""

from __future__ import annotations

import torch

from dspine.replica.engine import Engine
from dspine.training.corpus import read_texts


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """``length`` token ids uniform over the vocabulary, seeded (for models without a tokenizer)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()



def heldout_prompts(engine: Engine, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """Prompts cut from held-out stdlib files (never trained on); random ids without a tokenizer."""
    if engine.tokenizer is None:
        return [random_prompt(engine.target.args.vocab_size, prompt_len, seed=i) for i in range(num_prompts)]
    prompts = []
    for text in read_texts("heldout"):
        ids = engine.tokenizer.encode(text)
        for start in range(0, len(ids) - prompt_len - 1, max(prompt_len * 8, 512)):
            prompts.append(ids[start : start + prompt_len])
            if len(prompts) == num_prompts:
                return prompts
    return prompts
