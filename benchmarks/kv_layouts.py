"""``dspine bench engine --kv-layouts``: the target's K/V layouts compared in one run.

The same weights serve two engines, one per `EngineConfig.target_kv_layout`
("contiguous": per-request buffers, a padded copy of the batch's K/V every
step; "paged": the preallocated pool, new rows only). Each decodes the same
`num_requests` prompts of `prompt_len` tokens, all in flight at once,
target-only and speculatively. Both engines hold the same requests at once
and, after the prefills, their decode steps alternate (greedy, fixed drafting
plan: the two engines take identical steps), so a burst of load from another
process lands on both sides of each pair. Throughput is decode tokens over
the summed step times (median of the repeats); the ratio paged / contiguous
is the median over every pair of steps of t_contiguous / t_paged. The
K/V bytes each layout moved per decode step come from the counters
(`PagedKVPool.bytes_written` / `bytes_gathered`, `TargetModel.kv_copy_bytes`).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from dspine.replica.config import EngineConfig
from dspine.replica.device_thread import DeviceThread
from dspine.replica.engine import Engine, load_models
from dspine.replica.sampling import SamplingParams

LAYOUTS = ("contiguous", "paged")


def _decode_pair(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams,
                 speculative: bool, first: int) -> dict:
    """The same prompts in flight on every engine; after every prefill, decode steps alternate between
    the engines (the first one alternating too), each step timed. Greedy with a fixed drafting plan,
    both engines then take identical steps, so step i of one pairs with step i of the other and a
    burst of load from elsewhere lands on both. Returns per layout: decode seconds, tokens, per-step
    seconds, outputs and K/V traffic."""
    names = list(engines)
    state = {}
    for name, engine in engines.items():
        ids = [engine.add_request(p, params, speculative=speculative) for p in prompts]
        state[name] = {"ids": ids, "outputs": {i: [] for i in ids}, "step_seconds": []}

    def step(name):
        for event in engines[name].step():
            state[name]["outputs"][event.request.request_id] += event.release.token_ids

    for name in names:  # prefill (maybe over several steps), untimed
        while any(not t for t in state[name]["outputs"].values()):
            step(name)
    for name, engine in engines.items():
        pool = engine.runner.target_kv_pool
        state[name]["first_tokens"] = sum(len(t) for t in state[name]["outputs"].values())
        state[name]["before"] = ((pool.bytes_written, pool.bytes_gathered) if pool is not None else (0, 0),
                                 engine.target.kv_copy_bytes)
    i = first
    while any(engine.has_unfinished() for engine in engines.values()):
        order = names if i % 2 == 0 else names[::-1]
        i += 1
        for name in order:
            if engines[name].has_unfinished():
                start = time.perf_counter()
                step(name)
                state[name]["step_seconds"].append(time.perf_counter() - start)
    out = {}
    for name, engine in engines.items():
        st, pool = state[name], engine.runner.target_kv_pool
        (w0, g0), c0 = st["before"]
        w1, g1 = (pool.bytes_written, pool.bytes_gathered) if pool is not None else (0, 0)
        steps = max(len(st["step_seconds"]), 1)
        out[name] = {"seconds": sum(st["step_seconds"]), "step_seconds": st["step_seconds"],
                     "tokens": sum(len(t) for t in st["outputs"].values()) - st["first_tokens"],
                     "outputs": [st["outputs"][r] for r in st["ids"]],
                     "written_per_step": (w1 - w0) / steps, "gathered_per_step": (g1 - g0) / steps,
                     "copied_per_step": (engine.target.kv_copy_bytes - c0) / steps}
    return out


def bench_kv_layouts(target_dir: str | Path | None = None, draft_dir: str | Path | None = None,
                     num_requests: int = 8, prompt_len: int = 1024, new_tokens: int = 32, repeats: int = 2,
                     device: str = "cpu", dtype: str = "auto", adaptive: bool = False, models=None) -> dict:
    """Decode tokens/s per (layout, mode), the paged / contiguous ratios and per-step K/V traffic.
    Default models: the embedded pair; `models`: an already built (target, drafter or None).
    `adaptive`: adaptive speculation (off: every step drafts, so both layouts do the same work)."""
    base = dict(device=device, dtype=dtype, max_concurrency=num_requests, adaptive_speculation=adaptive)
    device_thread = DeviceThread()
    if models is None:
        if target_dir is None:
            from dspine import embedded

            target_dir, draft_dir = embedded.TARGET_DIR, draft_dir or embedded.DRAFT_DIR
        models = load_models(target_dir, draft_dir, EngineConfig(**base), device_thread)
    target, drafter = models
    engines = {layout: Engine(target, drafter, None, EngineConfig(**base, target_kv_layout=layout), device_thread)
               for layout in LAYOUTS}
    vocab = target.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    modes = {"target-only": False} | ({"speculative": True} if drafter is not None else {})
    for engine in engines.values():  # warm-up
        engine.generate_many([p[:32] for p in prompts[:2]], SamplingParams(max_new_tokens=4), speculative=False)
    runs = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for m, (mode, speculative) in enumerate(modes.items()):
            runs[mode].append(_decode_pair(engines, prompts, params, speculative, first=repeat + m))
    rows = []
    for mode in modes:
        pairs = runs[mode]
        tps = {layout: [r[layout]["tokens"] / r[layout]["seconds"] for r in pairs] for layout in LAYOUTS}
        step_ratios = [c / p for r in pairs for c, p in zip(r["contiguous"]["step_seconds"], r["paged"]["step_seconds"])]
        rows.append({
            "mode": mode,
            "contiguous_tokens_per_s": statistics.median(tps["contiguous"]),
            "paged_tokens_per_s": statistics.median(tps["paged"]),
            # paged / contiguous throughput: the median over all paired steps of t_contiguous / t_paged
            "ratio": statistics.median(step_ratios),
            "run_ratios": [p / c for p, c in zip(tps["paged"], tps["contiguous"])],
            "paired_steps": len(step_ratios),
            "identical_output": all(r["contiguous"]["outputs"] == r["paged"]["outputs"] for r in pairs),
            "contiguous_copied_per_step": statistics.median(r["contiguous"]["copied_per_step"] for r in pairs),
            "paged_written_per_step": statistics.median(r["paged"]["written_per_step"] for r in pairs),
            "paged_gathered_per_step": statistics.median(r["paged"]["gathered_per_step"] for r in pairs),
        })
    for engine in engines.values():
        assert engine.num_live_states()["target_kv_blocks"] == 0
    device_thread.close()
    return {"num_requests": num_requests, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
            "threads": torch.get_num_threads(), "rows": rows}


def format_kv_layouts(report: dict) -> str:
    """One table: decode tokens/s per layout and mode, the same-run ratio, and K/V bytes per decode step."""
    mib = 2**20
    lines = [f"target K/V layouts, {report['num_requests']} requests in flight x {report['prompt_len']}-token prompts, "
             f"{report['new_tokens']} new tokens each, greedy, {report['repeats']} repeats, ratio: median of paired steps, "
             f"{report['threads']} threads",
             f"{'mode':12} {'contiguous':>14} {'paged':>14} {'paged/contig':>13}  identical  "
             f"{'copied/step':>12} {'written/step':>13} {'gathered/step':>14}",
             "-" * 110]
    for row in report["rows"]:
        lines.append(f"{row['mode']:12} {row['contiguous_tokens_per_s']:10.1f} t/s {row['paged_tokens_per_s']:10.1f} t/s"
                     f" {row['ratio']:12.2f}x  {str(row['identical_output']):9}  "
                     f"{row['contiguous_copied_per_step'] / mib:8.2f} MiB {row['paged_written_per_step'] / mib:9.3f} MiB"
                     f" {row['paged_gathered_per_step'] / mib:10.2f} MiB")
    lines.append("copied: contiguous layout's padded batch buffer + copy-back per step; written: paged pool rows "
                 "stored (new rows only); gathered: the CPU attention path's transient per-layer reads")
    return "\n".join(lines)
