"""Fixtures for the gRPC edge: tiny random engines, a tiny BPE tokenizer, servers on real sockets.

A server runs on its own asyncio loop in a background thread and binds
127.0.0.1 on an ephemeral port, so the blocking SDK can be used from the test
thread. :class:`StepGate` holds the engine's steps so that "these requests are
in flight together" is a fact the test arranges, not a timing hope.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import textwrap
import threading

import pytest
import torch

from dspine.cluster.server import DSpineServer, ServerConfig
from dspine.replica import Engine, EngineConfig
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target import TargetModel
from dspine.replica.tokenizer import Tokenizer
from dspine_testing.models import make_target as shared_make_target
from dspine_testing.waiting import wait_until  # noqa: F401 - the tests here import it from conftest

VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Tiny models are latency-bound: extra intra-op threads only fight over the 2 shared cores.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_target(seed: int = 0) -> TargetModel:
    return shared_make_target("tiny", seed)


def make_engine(tokenizer=None, with_drafter: bool = True, max_seq_len: int = 96, **config) -> Engine:
    target = make_target()
    drafter = None
    if with_drafter:
        args = DraftArgs.for_target(target.args, window=8, num_retrieve=32)
        drafter = init_random_drafter(target, args, seed=0).eval()
    # A random drafter: adaptive speculation would soon stop drafting, and these tests look at
    # speculative cycles (stage spans, speculation stats) through the server.
    config = {"device": "cpu", "dtype": "float32", "max_seq_len": max_seq_len, "adaptive_speculation": False,
              **config}
    return Engine(target, drafter, tokenizer, EngineConfig(**config))


def _train_tokenizer(out_dir, chat_template: str | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([inspect.getsource(textwrap), inspect.getsource(json.decoder)], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>"}
    if chat_template:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(out_dir)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A directory with tokenizer.json + tokenizer_config.json (eos <|im_end|>, a ChatML template)."""
    out = tmp_path_factory.mktemp("tok")
    assert _train_tokenizer(out, CHAT_TEMPLATE).vocab_size <= VOCAB
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory):
    """The same kind of tokenizer without a chat template."""
    return _train_tokenizer(tmp_path_factory.mktemp("tok_plain"), None)




def idle(engine) -> bool:
    return engine.num_live_states() == {"requests": 0, "target_states": 0, "draft_slots": 0, "target_kv_blocks": 0}


class StepGate:
    """Wraps ``engine.step``: each step needs a permit (``allow(n)``) unless the gate is open.

    The wait happens before the step takes the engine lock, so admission and
    cancel keep working while steps are held.
    """

    def __init__(self, engine: Engine, open_: bool = False):
        self._step = engine.step
        self._cond = threading.Condition()
        self._permits: int | None = None if open_ else 0
        self.steps = 0
        engine.step = self._gated_step

    def _gated_step(self):
        with self._cond:
            ready = self._cond.wait_for(lambda: self._permits is None or self._permits > 0, timeout=30)
            assert ready, "StepGate: no permit for 30s (test forgot to open the gate?)"
            if self._permits is not None:
                self._permits -= 1
            self.steps += 1
        return self._step()

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self._permits = (self._permits or 0) + n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._permits = 0


class ServerThread:
    """A :class:`DSpineServer` on its own event loop thread."""

    def __init__(self, engine: Engine, config: ServerConfig, limits=None, metrics=None):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-server", daemon=True)
        self.thread.start()
        self.server = DSpineServer(engine, config, limits, metrics)
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Start ``coro`` on the server loop; returns a concurrent Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.run(self.server.stop(grace=5.0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def serve():
    """``serve(engine, **server_config) -> ServerThread``; stopped at teardown."""
    started: list[ServerThread] = []
    gates: list[StepGate] = []

    def start(engine: Engine, limits=None, metrics=None, **config) -> ServerThread:
        config.setdefault("host", "127.0.0.1")
        config.setdefault("port", 0)
        server = ServerThread(engine, ServerConfig(**config), limits, metrics)
        started.append(server)
        return server

    start.gates = gates
    yield start
    for gate in gates:
        gate.open()
    for server in started:
        server.close()


@pytest.fixture
def gate_for(serve):
    """``gate_for(engine) -> StepGate`` (closed); opened again at teardown before servers stop."""

    def make(engine: Engine, open_: bool = False) -> StepGate:
        gate = StepGate(engine, open_)
        serve.gates.append(gate)
        return gate

    return make


@pytest.fixture(scope="session")
def otlp():
    """An OTLP/gRPC receiver on a socket; this process (and every Ray process started after this
    fixture) exports its spans there. The process's tracer provider can be set only once, so the
    receiver lives for the whole session; tests pick their spans by trace id."""
    import os

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from opentelemetry import trace

    from dspine.cluster import tracing
    from dspine_testing.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
                       "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "500"})
    exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
    assert tracing.configure("dspine-test", processors=[BatchSpanProcessor(exporter, schedule_delay_millis=100)])
    yield receiver
    from opentelemetry import metrics

    for provider in (metrics.get_meter_provider(), trace.get_tracer_provider()):
        if hasattr(provider, "shutdown"):
            provider.shutdown()  # flush before the receiver goes
    receiver.close()
