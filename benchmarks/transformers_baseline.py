"""``dspine bench target``: target-only decode tokens/s of this engine vs transformers ``generate``
on the same checkpoint, in one run (transformers is a dev-only dependency: without it, no baseline)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspine.replica.config import EngineConfig
from dspine.replica.engine import Engine
from dspine.replica.sampling import SamplingParams

from .prompts import random_prompt


@dataclass
class TargetBenchReport:
    """Median decode tokens/s of this engine and of transformers on the same prompt, and whether they agree."""

    prompt_len: int
    new_tokens: int
    ours_tokens_per_s: float
    transformers_tokens_per_s: float | None
    same_tokens: bool | None

    def format(self) -> str:
        lines = [
            f"target-only greedy decode, prompt {self.prompt_len} tokens, {self.new_tokens} new tokens (median of runs)",
            f"  dspine engine          {self.ours_tokens_per_s:10.1f} tok/s",
        ]
        if self.transformers_tokens_per_s is not None:
            ratio = self.ours_tokens_per_s / self.transformers_tokens_per_s
            lines.append(f"  transformers generate  {self.transformers_tokens_per_s:10.1f} tok/s")
            lines.append(f"  ratio dspine / transformers: {ratio:.2f}x   identical tokens: {self.same_tokens}")
        else:
            lines.append("  transformers not installed: no baseline (pip install 'dspine-serve[dev]')")
        return "\n".join(lines)



def bench_target(target_dir: str | Path, prompt_len: int = 32, new_tokens: int = 64, repeats: int = 3,
                 device: str = "auto") -> TargetBenchReport:
    """Decode tokens/s of our target-only path and of transformers on the same model."""
    engine = Engine.from_pretrained(target_dir, None, EngineConfig(device=device, dtype="float32"))
    prompt = random_prompt(engine.target.args.vocab_size, prompt_len, seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompt, params, speculative=False)  # warm-up
    ours, our_tokens = [], None
    for _ in range(repeats):
        result = engine.generate(prompt, params, speculative=False)
        ours.append(result.stats.decode_tokens_per_second)
        our_tokens = result.token_ids
    try:
        import transformers  # noqa: F401 - dev-only baseline
    except ImportError:
        return TargetBenchReport(prompt_len, new_tokens, statistics.median(ours), None, None)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt])
    theirs, their_tokens = [], None
    with torch.inference_mode():
        model.generate(input_ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        for _ in range(repeats):
            # time the first token separately so both rates exclude prefill
            start = time.perf_counter()
            model.generate(input_ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
            elapsed = time.perf_counter() - start - prefill
            theirs.append((new_tokens - 1) / elapsed)
            their_tokens = out[0, prompt_len:].tolist()
    return TargetBenchReport(prompt_len, new_tokens, statistics.median(ours), statistics.median(theirs),
                             our_tokens == their_tokens)
