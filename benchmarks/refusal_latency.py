"""Probe: how fast does a full standalone server say RESOURCE_EXHAUSTED? (issue 20, item 7)

    python -m dspine.benchmarks.refusal_latency [--streams 200] [--slots 8] [--seconds 20] [--no-baseline]

Serves the embedded pair with ``max_concurrency = --slots`` on a local socket (in
a child process, so the callers do not compete for the server's GIL) and opens ``--streams`` concurrent GenerateStream callers. Each caller loops: open a
stream (token-id prompt, ``--max-new-tokens`` long, so admitted streams keep
their slots busy), read it to the end if admitted, or record how long the
RESOURCE_EXHAUSTED answer took and try again after 0.5-1.5 s (a client's backoff). Meanwhile
``--tokenizers`` callers send Tokenize calls of ``--tokenize-chars`` characters,
so tokenization competes for the server's threads as it does in production.

It prints p50 / p90 / max of the refusal latency and the share over 2 s, first
for the old design (baseline: admission and tokenization in one shared
executor, a full engine found only by ``engine.add_request`` behind the engine
lock, and tokenization holding the GIL; the fault points
``servicer.shared_executor``, ``servicer.admission_waits_for_engine`` and
``tokenizer.encode_holds_gil`` restore it), then for this build, and their
ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time

import grpc

from dspine import embedded, faults
from dspine.cluster.server import DSpineServer, ServerConfig
from dspine.protos.dspine.v1 import dspine_pb2 as pb
from dspine.protos.dspine.v1 import dspine_pb2_grpc as pb_grpc
from dspine.replica import Engine, EngineConfig

OLD_DESIGN = ("servicer.shared_executor", "servicer.admission_waits_for_engine", "tokenizer.encode_holds_gil")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200, help="concurrent GenerateStream callers")
    p.add_argument("--slots", type=int, default=8, help="the engine's max_concurrency")
    p.add_argument("--seconds", type=float, default=20.0, help="how long each phase runs")
    p.add_argument("--max-new-tokens", type=int, default=512, help="length of an admitted stream")
    p.add_argument("--tokenizers", type=int, default=4, help="concurrent Tokenize callers (0: none)")
    p.add_argument("--tokenize-chars", type=int, default=200_000, help="characters per Tokenize call")
    p.add_argument("--generators", type=int, default=0,
                   help="callers sending 2-token Generate calls one after another (their latency is printed)")
    p.add_argument("--no-baseline", action="store_true", help="measure this build only")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    p.add_argument("--old-design", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def _serve(args) -> None:
    """The server process: the embedded pair behind a standalone server, until stdin closes."""
    engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR,
                                    EngineConfig(device="cpu", max_concurrency=args.slots))

    async def run() -> None:
        server = DSpineServer(engine, ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0))
        port = await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        await server.stop(grace=5.0)

    with faults.inject(*(OLD_DESIGN if args.old_design else ())):
        asyncio.run(run())


class ServerProcess:
    """:func:`_serve` in a child process, so the callers' work does not take the server's GIL."""

    def __init__(self, args, old_design: bool):
        command = [sys.executable, "-m", "dspine.benchmarks.refusal_latency", "--serve", "--slots", str(args.slots)]
        self.process = subprocess.Popen(command + (["--old-design"] if old_design else []),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if not line.strip().isdigit():
            self.process.kill()
            raise SystemExit(f"the server process did not start (it printed {line!r})")
        self.port = int(line)

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def _stream_caller(stub, end: float, max_new_tokens: int, seed: int, refusals: list[float],
                         admitted: list[int]) -> None:
    n = 0
    while time.monotonic() < end:
        n += 1
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1 + (seed + n) % 97, 5, 9, 12]),
                                     sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                                     speculative=True)
        start = time.perf_counter()
        call = stub.GenerateStream(request, timeout=max(end - time.monotonic(), 0.1) + 30)
        try:
            async for _ in call:
                if time.monotonic() >= end:
                    call.cancel()
                    break
            admitted[0] += 1
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refusals.append(time.perf_counter() - start)
                await asyncio.sleep(random.uniform(0.5, 1.5))  # a client's backoff before it tries again
            elif e.code() != grpc.StatusCode.CANCELLED:
                raise
        except asyncio.CancelledError:
            call.cancel()
            raise


async def _generate_caller(stub, end: float, latencies: list[float]) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 5, 9]),
                                 sampling=pb.SamplingParams(max_new_tokens=2, ignore_eos=True))
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            await stub.Generate(request, timeout=120)
            latencies.append(time.perf_counter() - start)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
        await asyncio.sleep(0.1)


async def _tokenize_caller(stub, end: float, chars: int, done: list[int]) -> None:
    text = ("def wrap(text, width): return text " * (chars // 35 + 1))[:chars]
    while time.monotonic() < end:
        await stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120)
        done[0] += 1


async def _phase(port: int, args) -> dict:
    refusals: list[float] = []
    generations: list[float] = []
    admitted, tokenized = [0], [0]
    end = time.monotonic() + args.seconds
    options = [("grpc.max_send_message_length", 16 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = pb_grpc.DSpineStub(channel)
        tasks = [asyncio.create_task(_stream_caller(stub, end, args.max_new_tokens, i, refusals, admitted))
                 for i in range(args.streams)]
        tasks += [asyncio.create_task(_tokenize_caller(stub, end, args.tokenize_chars, tokenized))
                  for _ in range(args.tokenizers)]
        tasks += [asyncio.create_task(_generate_caller(stub, end, generations)) for _ in range(args.generators)]
        await asyncio.gather(*tasks)
    return {"refusals": refusals, "generations": generations, "admitted": admitted[0], "tokenized": tokenized[0]}


def _summary(name: str, result: dict) -> dict:
    if result["generations"]:
        gen = sorted(result["generations"])
        print(f"{name:>9}: {len(gen):6d} 2-token Generate calls  p50 {statistics.median(gen) * 1e3:8.1f} ms  "
              f"max {gen[-1] * 1e3:8.1f} ms  (tokenize calls {result['tokenized']})")
        if not result["refusals"]:
            return {"p50": statistics.median(gen), "p90": gen[int(0.9 * (len(gen) - 1))], "max": gen[-1]}
    lat = sorted(result["refusals"])
    if not lat:
        print(f"{name:>9}: no refusals (admitted {result['admitted']}); raise --streams")
        return {}
    q = statistics.quantiles(lat, n=10) if len(lat) > 1 else [lat[0]] * 9
    row = {"p50": statistics.median(lat), "p90": q[8], "max": lat[-1],
           "over_2s": sum(x > 2.0 for x in lat) / len(lat)}
    print(f"{name:>9}: {len(lat):6d} refusals  p50 {row['p50'] * 1e3:8.1f} ms  p90 {row['p90'] * 1e3:8.1f} ms  "
          f"max {row['max'] * 1e3:8.1f} ms  over 2 s {row['over_2s']:6.1%}  "
          f"(admitted streams {result['admitted']}, tokenize calls {result['tokenized']})")
    return row


def main() -> None:
    args = _parse()
    if args.serve:
        _serve(args)
        return
    if not embedded.available():
        raise SystemExit("the embedded pair is not in this installation (dspine train target / draft)")
    print(f"refusal latency: {args.streams} streams on {args.slots} slots, {args.seconds:g} s per phase, "
          f"{args.tokenizers} Tokenize callers of {args.tokenize_chars} characters")
    rows = {}
    for name, old_design in ((("baseline", True),) if not args.no_baseline else ()) + (("this", False),):
        server = ServerProcess(args, old_design)
        try:
            rows[name] = _summary(name, asyncio.run(_phase(server.port, args)))
        finally:
            server.close()
    base, this = rows.get("baseline"), rows["this"]
    if base and this:
        print("ratio baseline/this: " + "  ".join(f"{k} {base[k] / max(this[k], 1e-9):.1f}x"
                                                  for k in ("p50", "p90", "max")))


if __name__ == "__main__":
    main()
