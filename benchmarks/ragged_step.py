"""``python -m dspine.benchmarks.ragged_step``: one ragged target forward, real rows packed vs the padded grid.

Both sides in one run, alternating call by call (the fault ``target.pad_rows_for_gemms`` is the
padded side: every GEMM on the whole [B, T] grid), on the embedded target after a 64-token
prefill of each request. Prints the median milliseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspine import faults
from dspine.replica.models.loader import load_target

EMBEDDED_TARGET = Path(__file__).resolve().parent.parent / "embedded" / "target"


def time_step(model, lens: list[int], calls: int, prompt_len: int = 64) -> tuple[float, float]:
    """Median seconds of ``forward_step`` with rows ``lens`` (packed, padded), calls alternating."""
    torch.manual_seed(0)
    pool = model.new_kv_pool(num_blocks=len(lens) * (prompt_len + 2 * calls * max(lens)) // 16 + 8, block_size=16)
    states = [model.new_state(kv_pool=pool, request_id=f"r{i}") for i in range(len(lens))]
    seconds: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        model.forward_step([torch.randint(1, model.args.vocab_size, (prompt_len,)) for _ in lens], states,
                           logits="none")
        model.commit(states, [prompt_len] * len(lens))
        for call in range(2 * calls):
            padded = call % 2 == 1
            rows = [torch.randint(1, model.args.vocab_size, (n,)) for n in lens]
            with faults.inject(*(["target.pad_rows_for_gemms"] if padded else [])):
                start = time.perf_counter()
                model.forward_step(rows, states, feature_layers=(1, 3))
                seconds[padded].append(time.perf_counter() - start)
            model.commit(states, [1] * len(lens))
    return statistics.median(seconds[False]), statistics.median(seconds[True])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(EMBEDDED_TARGET))
    parser.add_argument("--calls", type=int, default=30, help="calls per side")
    args = parser.parse_args(argv)
    model = load_target(args.target).eval()
    for lens in ([16] + [1] * 7, [8] + [1] * 7, [16, 16] + [1] * 6, [5, 3, 8, 2, 6, 4, 7, 1], [16] * 8):
        packed, padded = time_step(model, lens, args.calls)
        print(f"rows {lens}: packed {packed * 1e3:.2f} ms, padded {padded * 1e3:.2f} ms, "
              f"packed / padded {packed / padded:.2f}x")


if __name__ == "__main__":
    main()
