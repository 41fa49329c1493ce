"""``dspine bench engine --kv-layouts``: the target's K/V layouts compared in one run.

The same weights serve two engines, one per `EngineConfig.target_kv_layout`
("contiguous": per-request buffers, a padded copy of the batch's K/V every
step; "paged": the preallocated pool, new rows only). Each decodes the same
`num_requests` prompts of `prompt_len` tokens, all in flight at once,
target-only and speculatively; repeats interleave the layouts (alternating
which goes first) so a slow stretch of a shared machine lands on both. Decode
throughput is timed from the step after the last prompt's prefill to the
end; the ratio paged / contiguous is the median of the paired repeats. The
K/V bytes each layout moved per decode step come from the counters
(`PagedKVPool.bytes_written` / `bytes_gathered`, `TargetModel.kv_copy_bytes`).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .config import EngineConfig
from .device_thread import DeviceThread
from .engine import Engine
from .sampling import SamplingParams

LAYOUTS = ("contiguous", "paged")


def _load(target_dir, draft_dir, config: EngineConfig, device_thread: DeviceThread):
    from .models.dspine_checkpoint import load_drafter
    from .models.loader import load_target

    def load():
        target = load_target(target_dir, device=config.torch_device, dtype=config.torch_dtype)
        drafter = None
        if draft_dir is not None:
            drafter = load_drafter(draft_dir, target.embed_tokens, target.lm_head_weight,
                                   device=config.torch_device, dtype=config.torch_draft_dtype)
        return target, drafter

    return device_thread.call(load)


def _decode_run(engine: Engine, prompts: list[list[int]], params: SamplingParams, speculative: bool) -> dict:
    """All prompts in flight; returns decode seconds/tokens (after every prefill), outputs and K/V traffic."""
    ids = [engine.add_request(p, params, speculative=speculative) for p in prompts]
    outputs = {i: [] for i in ids}

    def step():
        for event in engine.step():
            outputs[event.request.request_id] += event.release.token_ids

    while any(not tokens for tokens in outputs.values()):  # prefill (maybe over several steps)
        step()
    pool, target = engine.runner.target_kv_pool, engine.target
    first = sum(len(t) for t in outputs.values())
    before = (pool.bytes_written, pool.bytes_gathered) if pool is not None else (0, 0)
    copies_before, steps = target.kv_copy_bytes, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        step()
        steps += 1
    seconds = time.perf_counter() - start
    after = (pool.bytes_written, pool.bytes_gathered) if pool is not None else (0, 0)
    return {"seconds": seconds, "tokens": sum(len(t) for t in outputs.values()) - first, "steps": steps,
            "outputs": [outputs[i] for i in ids],
            "written_per_step": (after[0] - before[0]) / max(steps, 1),
            "gathered_per_step": (after[1] - before[1]) / max(steps, 1),
            "copied_per_step": (target.kv_copy_bytes - copies_before) / max(steps, 1)}


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
        models = _load(target_dir, draft_dir, EngineConfig(**base), device_thread)
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
    runs = {(layout, mode): [] for layout in LAYOUTS for mode in modes}
    for repeat in range(repeats):
        for m, (mode, speculative) in enumerate(modes.items()):
            order = LAYOUTS if (repeat + m) % 2 == 0 else LAYOUTS[::-1]
            for layout in order:
                runs[layout, mode].append(_decode_run(engines[layout], prompts, params, speculative))
    rows = []
    for mode in modes:
        old, new = runs["contiguous", mode], runs["paged", mode]
        tps = {layout: [r["tokens"] / r["seconds"] for r in runs[layout, mode]] for layout in LAYOUTS}
        rows.append({
            "mode": mode,
            "contiguous_tokens_per_s": statistics.median(tps["contiguous"]),
            "paged_tokens_per_s": statistics.median(tps["paged"]),
            "ratio": statistics.median(p / c for p, c in zip(tps["paged"], tps["contiguous"])),
            "run_ratios": [p / c for p, c in zip(tps["paged"], tps["contiguous"])],
            "identical_output": all(a["outputs"] == b["outputs"] for a, b in zip(old, new)),
            "contiguous_copied_per_step": statistics.median(r["copied_per_step"] for r in old),
            "paged_written_per_step": statistics.median(r["written_per_step"] for r in new),
            "paged_gathered_per_step": statistics.median(r["gathered_per_step"] for r in new),
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
             f"{report['new_tokens']} new tokens each, greedy, median of {report['repeats']} paired repeats, "
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
