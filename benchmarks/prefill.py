"""``dspine bench prefill``: peak activation memory of one long prefill, chunked vs unchunked, same run.

Three modes: the LM head over every prompt position (prefill before it computed the sampled
row only), unchunked, and chunked. Two measures per mode, each in a fresh subprocess (so one mode's allocations never shape the
other's): the peak bytes of live tensors created by the prefill (:class:`PeakLiveTensors`,
exact for torch allocations) and the growth of the process's peak RSS over the prefill
(``ru_maxrss``, what the OS saw, allocator included). The ratio is chunked / unchunked.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def _measure(target_dir: str, draft_dir: str | None, prompt_len: int, chunk: int, speculative: bool,
             all_logits: bool = False) -> dict:
    """One prefill of ``prompt_len`` tokens (then one sampled token) on a fresh engine. ``all_logits``:
    the LM head over every prompt position, as prefill did before it computed the sampled row only
    (the baseline of the memory figure; its sampled token is not meaningful)."""
    import torch

    from dspine.replica.config import EngineConfig
    from dspine.replica.engine import Engine
    from dspine.replica.memory_probe import PeakLiveTensors
    from dspine.replica.sampling import SamplingParams

    engine = Engine.from_pretrained(target_dir, draft_dir, EngineConfig(
        device="cpu", dtype="float32", prefill_chunk_tokens=chunk, max_seq_len=prompt_len + 64, max_concurrency=1,
        adaptive_speculation=False))
    if all_logits:
        forward_step = engine.target.forward_step
        engine.target.forward_step = lambda *a, **k: forward_step(*a, **{**k, "logits": "all"})
    prompt = torch.randint(0, engine.target.args.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), speculative=speculative)

    def run():
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        steps = 0
        with PeakLiveTensors() as probe:
            while engine.scheduler.num_unfinished:
                events = engine._step()
                steps += 1
                token = [e.release.token_ids for e in events if e.request.request_id == request_id]
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_live_tensor_bytes": probe.peak_bytes, "largest_tensor_bytes": probe.largest_bytes,
                "peak_rss_growth_bytes": (rss_after - rss_before) * 1024, "steps": steps,
                "first_token": token[0] if token else None}

    return engine.call_on_device_thread(run)


def bench_prefill(target_dir: str, draft_dir: str | None, prompt_len: int = 4096, chunk: int = 512,
                  speculative: bool = True) -> dict:
    """Unchunked (one forward of the whole prompt) vs ``chunk``-token chunks, each mode in a subprocess."""
    modes = {}
    for name, tokens, all_logits in (("all logits", prompt_len, True), ("unchunked", prompt_len, False),
                                     ("chunked", chunk, False)):
        code = (f"import json; from dspine.benchmarks.prefill import _measure; "
                f"print(json.dumps(_measure({target_dir!r}, {draft_dir!r}, {prompt_len}, {tokens}, {speculative}, "
                f"{all_logits})))")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        modes[name] = json.loads(out.strip().splitlines()[-1])
    unchunked, chunked = modes["unchunked"], modes["chunked"]
    return {"prompt_len": prompt_len, "chunk": chunk, "speculative": speculative, **modes,
            "same_first_token": unchunked["first_token"] == chunked["first_token"],
            "live_tensor_ratio": chunked["peak_live_tensor_bytes"] / unchunked["peak_live_tensor_bytes"],
            "last_row_logits_ratio": unchunked["peak_live_tensor_bytes"] / modes["all logits"]["peak_live_tensor_bytes"],
            "rss_ratio": (chunked["peak_rss_growth_bytes"] / unchunked["peak_rss_growth_bytes"]
                          if unchunked["peak_rss_growth_bytes"] else None)}


def format_report(r: dict) -> str:
    """``bench_prefill``'s result as the table ``dspine bench prefill`` prints."""
    mib = 1 << 20
    lines = [f"prefill of {r['prompt_len']:,} tokens (speculative={r['speculative']}): unchunked vs "
             f"{r['chunk']}-token chunks, same run"]
    for name in ("all logits", "unchunked", "chunked"):
        m = r[name]
        lines.append(f"  {name:<10} peak live tensors {m['peak_live_tensor_bytes'] / mib:8.1f} MiB   largest tensor "
                     f"{m['largest_tensor_bytes'] / mib:7.1f} MiB   peak RSS growth "
                     f"{m['peak_rss_growth_bytes'] / mib:8.1f} MiB   steps {m['steps']}")
    rss = f"{r['rss_ratio']:.3f}x" if r["rss_ratio"] is not None else "n/a"
    lines.append(f"  unchunked / all logits (before): live tensors {r['last_row_logits_ratio']:.3f}x")
    lines.append(f"  chunked / unchunked: live tensors {r['live_tensor_ratio']:.3f}x, peak RSS growth {rss}; "
                 f"first token identical: {r['same_first_token']}")
    return "\n".join(lines)
