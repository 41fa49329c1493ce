"""The benches' load generator: streaming requests through a gRPC server, or the same workload inline."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from dspine.cluster.client import AsyncDSpineClient
from dspine.cluster.client_errors import DSpineClientError


@dataclass
class LoadReport:
    """One workload's client-side figures."""

    name: str
    num_requests: int
    concurrency: int
    wall_s: float
    tokens: int
    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per request: seconds per token after the first
    errors: Counter = field(default_factory=Counter)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        return {"name": self.name, "requests": self.num_requests, "concurrency": self.concurrency,
                "tokens_per_s": round(self.tokens_per_s, 1), "latency_p50_s": percentile(self.latencies_s, 50),
                "ttft_p50_s": percentile(self.ttft_s, 50), "ttft_p99_s": percentile(self.ttft_s, 99),
                "itl_p50_ms": _ms(percentile(self.itl_s, 50)), "itl_p99_ms": _ms(percentile(self.itl_s, 99)),
                "errors": dict(self.errors)}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``, rounded to 4 decimals; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 4)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


async def run_load(address: str, name: str, prompts: list[list[int]], concurrency: int, sampling: dict,
                   application: str | None = None, timeout_s: float = 300.0,
                   max_new_tokens: list[int] | None = None) -> LoadReport:
    """Stream every prompt through the gRPC server at ``address``, ``concurrency`` at a time
    (``max_new_tokens``: each prompt's own, over ``sampling``'s)."""
    report = LoadReport(name, len(prompts), concurrency, 0.0, 0)
    if max_new_tokens is not None and len(max_new_tokens) != len(prompts):
        raise ValueError(f"max_new_tokens: one per prompt ({len(prompts)}), got {len(max_new_tokens)}")
    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        own = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens[index]}
        queue.put_nowait((prompt, {**sampling, **own}))

    async def worker(client: AsyncDSpineClient) -> None:
        while not queue.empty():
            prompt, prompt_sampling = queue.get_nowait()
            start = time.perf_counter()
            first = None
            tokens = 0
            try:
                async for chunk in client.generate_stream(token_ids=prompt, **prompt_sampling):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
            except DSpineClientError as e:
                report.errors[e.code.name] += 1
                continue
            end = time.perf_counter()
            report.tokens += tokens
            report.latencies_s.append(end - start)
            if first is not None:
                report.ttft_s.append(first - start)
                if tokens > 1:
                    report.itl_s.append((end - first) / (tokens - 1))

    async with AsyncDSpineClient(address, application=application, timeout=timeout_s) as client:
        await client.wait_ready(30)
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        report.wall_s = time.perf_counter() - start
    return report


def run_inline(engine, name: str, prompts: list[list[int]], concurrency: int, params) -> LoadReport:
    """The same workload straight into one engine, stepping inline (no server, no network)."""
    report = LoadReport(name, len(prompts), concurrency, 0.0, 0)
    start = time.perf_counter()
    if concurrency == 1:
        for prompt in prompts:
            t0 = time.perf_counter()
            result = engine.generate(prompt, params)
            report.latencies_s.append(time.perf_counter() - t0)
            report.tokens += len(result.token_ids)
            if result.stats.time_to_first_token is not None:
                report.ttft_s.append(result.stats.time_to_first_token)
    else:
        for result in engine.generate_many(prompts, params):
            report.tokens += len(result.token_ids)
            if result.stats.time_to_first_token is not None:
                report.ttft_s.append(result.stats.time_to_first_token)
    report.wall_s = time.perf_counter() - start
    return report

