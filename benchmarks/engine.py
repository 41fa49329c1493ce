"""``dspine bench engine``: the same prompts decoded target-only and speculatively in one run, with the
speedup (a ratio against the target-only baseline of the same run), acceptance, stage breakdown and the
article's cost-model bound."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from dspine import faults
from dspine.progress import Progress
from dspine.replica.config import EngineConfig
from dspine.replica.engine import Engine
from dspine.replica.sampling import SamplingParams
from dspine.replica.step_stats import StepRecord, write_chrome_trace
from dspine.replica.types import SpecDecodingStats, StageTimes

from .paired import Pair, bootstrap_interval
from .prompts import heldout_prompts


@dataclass
class EngineBenchReport:
    """``bench_engine``'s figures: both modes' run times per repeat, acceptance, stages, the cost model."""

    num_prompts: int
    concurrency: int
    temperature: float
    target_only_tokens: int  # per run
    speculative_tokens: int  # per run
    # per repeat, its paired groups (both modes of the same prompts, adjacent in time): the run
    # times and the interval are read from these
    repeat_pairs: list[list[Pair]]
    mean_accepted_len: float
    mean_verified_len: float  # draft tokens verified per cycle (dynamic verification: <= block - 1)
    accepted_len_histogram: list[int]  # cycles of one speculative run
    stage_seconds: dict  # per cycle, averaged over every speculative run
    target_step_seconds: float  # mean target-only step (C_t)
    cycle_seconds: float  # mean speculative cycle (C_d + C_v)
    identical_greedy_output: bool | None
    config: dict = field(default_factory=dict)  # the engine settings that shape the figures
    gemm_probe_us: list[float] = field(default_factory=list)  # per repeat: see gemm_probe()
    # per repeat: the mean over its requests of admission to last token (what one user waits)
    target_only_request_seconds: list[float] = field(default_factory=list)
    speculative_request_seconds: list[float] = field(default_factory=list)

    @property
    def pairs(self) -> list[Pair]:
        """Every paired group of every repeat: what the interval resamples."""
        return [pair for pairs in self.repeat_pairs for pair in pairs]

    @property
    def target_only_run_seconds(self) -> list[float]:
        """Per repeat, the target-only side's seconds over all its groups."""
        return [sum(p.target_only_seconds for p in pairs) for pairs in self.repeat_pairs]

    @property
    def speculative_run_seconds(self) -> list[float]:
        """Per repeat, the speculative side's seconds over all its groups."""
        return [sum(p.speculative_seconds for p in pairs) for pairs in self.repeat_pairs]

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
    def request_speedups(self) -> list[float]:
        """Per repeat, target-only over speculative mean request latency (the same tokens per request).

        With several requests in flight this is not :attr:`run_speedups`: a load's tokens per second
        run to its last request's end, and speculative requests finish at different steps, so the
        last ones decode in a thinner batch whose steps cost nearly a full one's; each user waits
        only for their own request."""
        return [t / s for t, s in zip(self.target_only_request_seconds, self.speculative_request_seconds) if s > 0]

    @property
    def request_speedup(self) -> float | None:
        """Median of :attr:`request_speedups` (None before any)."""
        return statistics.median(self.request_speedups) if self.request_speedups else None

    @cached_property
    def interval(self) -> tuple[float, float] | None:
        """The 95% bootstrap interval of the pooled ratio over :attr:`pairs` (None without pairs;
        computed once: 2,000 resamples are read by the table, the text and the JSON)."""
        return bootstrap_interval(self.pairs) if self.pairs else None

    @property
    def cost_model_speedup(self) -> float:
        """C_t / ((C_d + C_v) / tau): what the measured cycle cost and acceptance imply."""
        tau = self.mean_accepted_len + 1.0
        return self.target_step_seconds / (self.cycle_seconds / tau) if self.cycle_seconds else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(target_only_run_seconds=self.target_only_run_seconds,
                    speculative_run_seconds=self.speculative_run_seconds,
                    target_only_seconds=self.target_only_seconds, speculative_seconds=self.speculative_seconds,
                    target_only_tokens_per_s=self.target_only_tokens_per_s,
                    speculative_tokens_per_s=self.speculative_tokens_per_s, run_speedups=self.run_speedups,
                    speedup=self.speedup, cost_model_speedup=self.cost_model_speedup,
                    request_speedups=self.request_speedups, request_speedup=self.request_speedup,
                    interval=self.interval)
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
        ]
        if self.interval is not None:
            low, high = self.interval
            lines.append(f"  95% interval  {low:.2f}-{high:.2f}   (bootstrap over {len(self.pairs)} paired groups "
                         "of their pooled ratio)")
        if self.concurrency > 1 and self.request_speedup is not None:
            lines.append(f"  per request   {self.request_speedup:9.2f}x  (mean latency, target-only "
                         f"{statistics.median(self.target_only_request_seconds):.2f} s, speculative "
                         f"{statistics.median(self.speculative_request_seconds):.2f} s)")
        lines += [
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


def bench_engine(target_dir, draft_dir, params: SamplingParams | list[SamplingParams], num_prompts: int = 8,
                 prompt_len: int = 64,
                 concurrency: int = 1, device: str = "auto", dtype: str = "auto", engine: Engine | None = None,
                 prompts: list[list[int]] | None = None, repeats: int = 3,
                 config: EngineConfig | None = None, trace_out: str | Path | None = None,
                 load_size: int | None = None, control: bool = False) -> EngineBenchReport:
    """Decode the same prompts target-only and speculatively, ``repeats`` times each, in one run.

    The two modes are interleaved load by load, alternating which mode goes first, so a slow
    stretch on a shared machine lands on both sides of the comparison; each repeat gives one
    paired ratio and the reported speedup is their median. A load is ``load_size`` prompts
    (default ``concurrency``) decoded with ``concurrency`` in flight: at the default the load's
    requests start together and the last ones finish in a thinner batch; a larger load gives each
    finished request's slot to the next prompt, as a replica under load does. ``control``: the
    "speculative" side decodes target-only too, so the ratio is the bench's own scatter on this
    machine. ``trace_out``: write the first repeat's steps as a Chrome/Perfetto trace. ``params``:
    one for every prompt, or a list with each prompt's own (the same sampling but for their
    ``max_new_tokens``)."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    if engine is None:
        config = config or EngineConfig(device=device, dtype=dtype, max_concurrency=max(concurrency, 1))
        engine = Engine.from_pretrained(target_dir, draft_dir, config)
    prompts = prompts or heldout_prompts(engine, num_prompts, prompt_len)
    prompt_params = [SamplingParams(**{**asdict(p), "ignore_eos": True})
                     for p in (params if isinstance(params, list) else [params] * len(prompts))]
    if len(prompt_params) != len(prompts):
        raise ValueError(f"params: one per prompt ({len(prompts)}), got {len(prompt_params)}")
    params = prompt_params[0]
    if not control:
        engine.generate(prompts[0], SamplingParams(max_new_tokens=4), speculative=True)  # warm-up
    engine.generate(prompts[0], SamplingParams(max_new_tokens=4), speculative=False)

    load_size = concurrency if load_size is None else load_size
    if load_size < concurrency:
        raise ValueError(f"load_size: must be >= concurrency ({concurrency}), got {load_size}")
    groups = [prompts[i : i + load_size] for i in range(0, len(prompts), load_size)]
    group_params = [prompt_params[i : i + load_size] for i in range(0, len(prompts), load_size)]
    repeat_pairs: list[list[Pair]] = []
    base_latency, spec_latency = [], []
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
        pairs: list[Pair] = []
        results = {False: [], True: []}
        latencies: dict[bool, list[float]] = {False: [], True: []}
        for g, group in enumerate(groups):
            group_seconds, group_tokens = {}, {}
            for speculative in ((False, True) if (repeat + g) % 2 == 0 else (True, False)):
                start = time.perf_counter()
                load = engine.generate_many(group, group_params[g], speculative=speculative and not control,
                                            max_in_flight=concurrency)
                group_seconds[speculative] = time.perf_counter() - start
                group_tokens[speculative] = sum(len(r.token_ids) for r in load)
                results[speculative] += load
                latencies[speculative] += request_latencies(load, start)
            pairs.append(Pair(group_seconds[False], group_seconds[True], group_tokens[False], group_tokens[True]))
            progress.update(1)
        repeat_pairs.append(pairs)
        base_latency.append(statistics.fmean(latencies[False]))
        spec_latency.append(statistics.fmean(latencies[True]))
        base_results = base_results or results[False]
        spec_results = spec_results or results[True]
        for result in results[True]:
            stages.add(result.stats.stage_times)
            cycles += result.stats.spec.num_cycles if result.stats.spec is not None else 0  # None: control
        target_step += sum(r.stats.stage_times.target_step for r in results[False])
        base_steps += sum(max(0, r.stats.num_output_tokens - 1) for r in results[False])
    progress.close()
    if trace_out is not None:
        if repeats == 1:
            engine.remove_step_observer(records.append)
        write_chrome_trace(records, trace_out)
    spec = SpecDecodingStats(engine.block_size - 1)
    for result in spec_results:
        if result.stats.spec is not None:
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
        repeat_pairs=repeat_pairs,
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
        target_only_request_seconds=base_latency, speculative_request_seconds=spec_latency,
    )


def request_latencies(results, load_start: float) -> list[float]:
    """Seconds from each request's admission to its last token (``results``: one load's
    GenerationResults; ``load_start``: when the load began, ``time.perf_counter()``)."""
    if faults.active("bench.latency_from_load_start"):
        return [r.stats.finish_time - load_start for r in results]
    return [r.stats.finish_time - r.stats.arrival_time for r in results]
