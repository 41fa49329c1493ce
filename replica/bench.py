"""Benchmarks: every figure is a ratio against a baseline measured in the same run.

``bench_target``  target-only decode tokens/s of this engine vs transformers ``generate``
                  on the same checkpoint (transformers is a dev-only dependency).
``bench_engine``  the same prompts decoded target-only and speculatively, with the
                  speedup, acceptance, stage breakdown and the article's cost-model bound.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspine.progress import Progress
from .config import EngineConfig
from .engine import Engine
from .sampling import SamplingParams
from .step_stats import StepRecord, write_chrome_trace
from .types import SpecDecodingStats, StageTimes


@dataclass
class TargetBenchReport:
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


def _prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def bench_target(target_dir: str | Path, prompt_len: int = 32, new_tokens: int = 64, repeats: int = 3,
                 device: str = "auto") -> TargetBenchReport:
    """Decode tokens/s of our target-only path and of transformers on the same model."""
    engine = Engine.from_pretrained(target_dir, None, EngineConfig(device=device, dtype="float32"))
    prompt = _prompt(engine.target.args.vocab_size, prompt_len, seed=0)
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


@dataclass
class EngineBenchReport:
    num_prompts: int
    concurrency: int
    temperature: float
    target_only_tokens: int  # per run
    speculative_tokens: int  # per run
    target_only_run_seconds: list[float]  # one entry per repeat
    speculative_run_seconds: list[float]
    mean_accepted_len: float
    mean_verified_len: float  # draft tokens verified per cycle (dynamic verification: <= block - 1)
    accepted_len_histogram: list[int]  # cycles of one speculative run
    stage_seconds: dict  # per cycle, averaged over every speculative run
    target_step_seconds: float  # mean target-only step (C_t)
    cycle_seconds: float  # mean speculative cycle (C_d + C_v)
    identical_greedy_output: bool | None
    config: dict = field(default_factory=dict)  # the engine settings that shape the figures
    gemm_probe_us: list[float] = field(default_factory=list)  # per repeat: see gemm_probe()

    @property
    def target_only_seconds(self) -> float:
        return statistics.median(self.target_only_run_seconds)

    @property
    def speculative_seconds(self) -> float:
        return statistics.median(self.speculative_run_seconds)

    @property
    def target_only_tokens_per_s(self) -> float:
        return self.target_only_tokens / self.target_only_seconds

    @property
    def speculative_tokens_per_s(self) -> float:
        return self.speculative_tokens / self.speculative_seconds

    @property
    def run_speedups(self) -> list[float]:
        """Speculative over target-only tokens/s of each repeat (the two modes interleaved group by group)."""
        return [(self.speculative_tokens / s) / (self.target_only_tokens / t)
                for t, s in zip(self.target_only_run_seconds, self.speculative_run_seconds)]

    @property
    def speedup(self) -> float:
        """Median over repeats of the paired ratio: robust to a noisy moment on a shared machine."""
        return statistics.median(self.run_speedups)

    @property
    def cost_model_speedup(self) -> float:
        """C_t / ((C_d + C_v) / tau): what the measured cycle cost and acceptance imply."""
        tau = self.mean_accepted_len + 1.0
        return self.target_step_seconds / (self.cycle_seconds / tau) if self.cycle_seconds else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(target_only_seconds=self.target_only_seconds, speculative_seconds=self.speculative_seconds,
                    target_only_tokens_per_s=self.target_only_tokens_per_s,
                    speculative_tokens_per_s=self.speculative_tokens_per_s, run_speedups=self.run_speedups,
                    speedup=self.speedup, cost_model_speedup=self.cost_model_speedup)
        return data

    def format(self) -> str:
        stage_total = sum(self.stage_seconds.values()) or 1.0
        stages = ", ".join(f"{k} {v * 1e3:.2f} ms ({100 * v / stage_total:.0f}%)" for k, v in self.stage_seconds.items())
        runs = ", ".join(f"{r:.2f}" for r in self.run_speedups)
        settings = ", ".join(f"{k} {v}" for k, v in self.config.items())
        lines = [
            f"{self.num_prompts} prompts, concurrency {self.concurrency}, temperature {self.temperature}"
            + (f" ({settings})" if settings else ""),
            f"  target-only   {self.target_only_tokens_per_s:9.1f} tok/s  ({self.target_only_tokens} tokens, "
            f"median {self.target_only_seconds:.2f} s)",
            f"  speculative   {self.speculative_tokens_per_s:9.1f} tok/s  ({self.speculative_tokens} tokens, "
            f"median {self.speculative_seconds:.2f} s)",
            f"  speedup       {self.speedup:9.2f}x  (median of {len(self.run_speedups)} paired runs: {runs})",
            f"  mean accepted length {self.mean_accepted_len:.2f} (committed per cycle {self.mean_accepted_len + 1:.2f}; "
            f"verified per cycle {self.mean_verified_len:.2f})",
            f"  accepted-length histogram {self.accepted_len_histogram}",
            f"  per-cycle stages: {stages}",
            f"  cost model: C_t {self.target_step_seconds * 1e3:.2f} ms, C_d + C_v {self.cycle_seconds * 1e3:.2f} ms, "
            f"(C_d + C_v) / tau {self.cycle_seconds * 1e3 / (self.mean_accepted_len + 1):.2f} ms/token "
            f"-> bound {self.cost_model_speedup:.2f}x",
        ]
        if self.gemm_probe_us:
            probes = ", ".join(f"{p:.0f}" for p in self.gemm_probe_us)
            lines.append(f"  machine state: 16-row GEMM probe {probes} us per repeat (compare runs by this)")
        if self.identical_greedy_output is not None:
            lines.append(f"  greedy speculative output identical to target-only: {self.identical_greedy_output}")
        return "\n".join(lines)


def gemm_probe(device: torch.device | str = "cpu", iters: int = 200) -> float:
    """Microseconds per [16, 256] x [256, 768] fp32 GEMM: the shape of a verify forward's linears.

    Shared machines change speed under their neighbours, and verify-sized GEMMs feel it more
    than single-token steps; a probe taken next to each paired run says which state it saw."""
    x = torch.randn(16, 256, device=device)
    w = torch.randn(768, 256, device=device)
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.nn.functional.linear(x, w)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters * 1e6


def heldout_prompts(engine: Engine, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """Prompts cut from held-out stdlib files (never trained on); random ids without a tokenizer."""
    if engine.tokenizer is None:
        return [_prompt(engine.target.args.vocab_size, prompt_len, seed=i) for i in range(num_prompts)]
    from .train.corpus import read_texts

    prompts = []
    for text in read_texts("heldout"):
        ids = engine.tokenizer.encode(text)
        for start in range(0, len(ids) - prompt_len - 1, max(prompt_len * 8, 512)):
            prompts.append(ids[start : start + prompt_len])
            if len(prompts) == num_prompts:
                return prompts
    return prompts


def bench_engine(target_dir, draft_dir, params: SamplingParams, num_prompts: int = 8, prompt_len: int = 64,
                 concurrency: int = 1, device: str = "auto", dtype: str = "auto", engine: Engine | None = None,
                 prompts: list[list[int]] | None = None, repeats: int = 3,
                 config: EngineConfig | None = None, trace_out: str | Path | None = None) -> EngineBenchReport:
    """Decode the same prompts target-only and speculatively, ``repeats`` times each, in one run.

    The two modes are interleaved group by group (a group is ``concurrency`` prompts decoded
    together), alternating which mode goes first, so a slow stretch on a shared machine lands
    on both sides of the comparison; each repeat gives one paired ratio and the reported speedup
    is their median. ``trace_out``: write the first repeat's steps as a Chrome/Perfetto trace."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    if engine is None:
        config = config or EngineConfig(device=device, dtype=dtype, max_concurrency=max(concurrency, 1))
        engine = Engine.from_pretrained(target_dir, draft_dir, config)
    prompts = prompts or heldout_prompts(engine, num_prompts, prompt_len)
    params = SamplingParams(**{**asdict(params), "ignore_eos": True})
    engine.generate(prompts[0], SamplingParams(max_new_tokens=4), speculative=True)  # warm-up
    engine.generate(prompts[0], SamplingParams(max_new_tokens=4), speculative=False)

    groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    base_seconds, spec_seconds = [], []
    base_results = spec_results = None
    stages, cycles, target_step, base_steps = StageTimes(), 0, 0.0, 0
    probes = []
    records: list[StepRecord] = []
    if trace_out is not None:
        engine.add_step_observer(records.append)
    progress = Progress(repeats * len(groups), "bench engine", unit="paired groups")
    for repeat in range(repeats):
        if repeat == 1 and trace_out is not None:
            engine.remove_step_observer(records.append)
        # On the engine's thread: a parallel op on a second thread would slow both (device_thread.py).
        probes.append(engine.call_on_device_thread(gemm_probe, engine.device))
        seconds = {False: 0.0, True: 0.0}
        results = {False: [], True: []}
        for g, group in enumerate(groups):
            for speculative in ((False, True) if (repeat + g) % 2 == 0 else (True, False)):
                start = time.perf_counter()
                results[speculative] += engine.generate_many(group, params, speculative=speculative)
                seconds[speculative] += time.perf_counter() - start
            progress.update(1)
        base_seconds.append(seconds[False])
        spec_seconds.append(seconds[True])
        base_results = base_results or results[False]
        spec_results = spec_results or results[True]
        for result in results[True]:
            stages.add(result.stats.stage_times)
            cycles += result.stats.spec.num_cycles
        target_step += sum(r.stats.stage_times.target_step for r in results[False])
        base_steps += sum(max(0, r.stats.num_output_tokens - 1) for r in results[False])
    progress.close()
    if trace_out is not None:
        if repeats == 1:
            engine.remove_step_observer(records.append)
        write_chrome_trace(records, trace_out)
    spec = SpecDecodingStats(engine.block_size - 1)
    for result in spec_results:
        spec.merge(result.stats.spec)
    per_cycle = {name: getattr(stages, name) / max(1, cycles) for name in ("draft", "tail", "verify", "commit")}
    identical = None
    if params.is_greedy:
        identical = all(a.token_ids == b.token_ids for a, b in zip(base_results, spec_results))
    config = engine.config
    return EngineBenchReport(
        num_prompts=len(prompts), concurrency=concurrency, temperature=params.temperature,
        target_only_tokens=sum(len(r.token_ids) for r in base_results),
        speculative_tokens=sum(len(r.token_ids) for r in spec_results),
        target_only_run_seconds=base_seconds, speculative_run_seconds=spec_seconds,
        mean_accepted_len=spec.mean_accepted_len,
        mean_verified_len=spec.num_draft_tokens / max(1, spec.num_cycles),
        accepted_len_histogram=spec.accepted_len_histogram,
        stage_seconds=per_cycle,
        # Per-request stage times are the full wall time of each step a request took part in, so
        # these sums over requests, per request-step, are already per engine step.
        target_step_seconds=target_step / max(1, base_steps),
        cycle_seconds=sum(per_cycle.values()),
        identical_greedy_output=identical,
        config={"verify_threshold": config.verify_threshold, "retrieval": config.retrieval_mode,
                "threads": torch.get_num_threads()},
        gemm_probe_us=probes,
    )


# The regimes of ``dspine bench engine --sweep``: (name, sampling overrides, max_new_tokens, concurrency).
SWEEP_REGIMES = (
    ("greedy, 128 new tokens", {}, 128, 1),
    ("greedy, first 48 new tokens", {}, 48, 1),
    ("temperature 0.7", {"temperature": 0.7}, 128, 1),
    ("temperature 0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}, 128, 1),
    ("8 in flight, greedy", {}, 128, 8),
    ("8 in flight, temperature 0.7", {"temperature": 0.7}, 128, 8),
)


def bench_sweep(engine: Engine, num_prompts: int = 8, prompt_len: int = 64, repeats: int = 3, seed: int = 0,
                regimes=SWEEP_REGIMES) -> list[dict]:
    """Every regime through :func:`bench_engine` on one engine (target-only and speculative interleaved,
    paired repeats); one row per regime with the same-run ratio and the speculation policy's drafting
    share. With 8 in flight the prompts are repeated so that every group holds 8 requests."""
    prompts = heldout_prompts(engine, num_prompts, prompt_len)
    policy = engine.scheduler.policy
    rows = []
    for name, overrides, max_new_tokens, concurrency in regimes:
        params = SamplingParams(**{"max_new_tokens": max_new_tokens, "seed": seed, **overrides})
        group = prompts if concurrency == 1 else (prompts * concurrency)[: max(len(prompts), concurrency)]
        steps_before = (policy.num_decode_steps, policy.num_drafting_steps) if policy is not None else (0, 0)
        report = bench_engine(None, None, params, concurrency=concurrency, engine=engine, prompts=group,
                              repeats=repeats)
        share = None
        if policy is not None:
            decode = policy.num_decode_steps - steps_before[0]
            share = (policy.num_drafting_steps - steps_before[1]) / decode if decode else 0.0
        rows.append({"regime": name, "speedup": report.speedup, "run_speedups": report.run_speedups,
                     "target_only_tokens_per_s": report.target_only_tokens_per_s,
                     "speculative_tokens_per_s": report.speculative_tokens_per_s,
                     "mean_accepted_len": report.mean_accepted_len, "mean_verified_len": report.mean_verified_len,
                     "drafting_share": share, "identical_greedy_output": report.identical_greedy_output})
    return rows


def format_sweep(rows: list[dict]) -> str:
    """The sweep as one table (ratios against target-only measured in the same run)."""
    lines = [f"{'regime':32} {'target-only':>12} {'speculative':>12} {'ratio':>7} {'accepted':>9} {'verified':>9}"
             f" {'drafting':>9}  identical",
             "-" * 106]
    def figure(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    for row in rows:
        share = "-" if row["drafting_share"] is None else f"{100 * row['drafting_share']:.0f}%"
        identical = "" if row["identical_greedy_output"] is None else str(row["identical_greedy_output"])
        lines.append(f"{row['regime']:32} {row['target_only_tokens_per_s']:8.1f} t/s {row['speculative_tokens_per_s']:8.1f}"
                     f" t/s {row['speedup']:6.2f}x {figure(row['mean_accepted_len']):>9} {figure(row['mean_verified_len']):>9}"
                     f" {share:>9}  {identical}")
    lowest = min(rows, key=lambda row: row["speedup"])
    lines.append(f"lowest: {lowest['speedup']:.2f}x ({lowest['regime']}); drafting = share of the speculative runs' "
                 "decode steps that drafted")
    return "\n".join(lines)
