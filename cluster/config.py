"""The cluster's one configuration model.

Everything a deployment of the dspine.v1 service on Ray Serve can set lives
here; the serve-config YAML (``args:`` of the application), the ``dspine
serve`` flags and the Ray Serve deployment options are all derived from it,
so two settings that must agree can never disagree. In particular the
engine replica's ``max_ongoing_requests`` *is* ``engine.max_concurrency``:
there is no second knob.

    config = ClusterConfig(replicas=ReplicaSettings(num_replicas=2))
    config.engine_deployment_options()   # what @serve.deployment gets
    config.serve_config()                # the YAML `serve deploy` takes
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "DSpineIngress"
APP_IMPORT_PATH = "dspine.cluster.app:build_app"
GRPC_SERVICER_FUNCTION = "dspine.cluster.servicer.add_to_server"

# Serve runs user code on a second event loop thread by default; every streamed chunk then
# crosses threads once more and contends for the GIL with the engine's device thread. On the
# replica's own loop the cluster's latency overhead at concurrency 1 measured 1.26x -> 1.20x
# (README, "Architecture"). Our handlers never block the loop (engine calls run in executors).
_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSettings(_Strict):
    """Where the weights are. Unset target: the embedded tiny trained pair."""

    target_dir: str | None = Field(None, description="HF-format target directory; None: the embedded target")
    draft_dir: str | None = Field(None, description="DSpine draft directory; None with no target_dir: the embedded drafter")
    sampled_draft_dir: str | None = Field(
        None, description="a second DSpine draft directory (same config.json as draft_dir) for requests with "
                          "temperature >= engine.sampled_draft_min_temperature; None: one drafter (with neither "
                          "target_dir nor draft_dir: the embedded draft-sampled/ when shipped)")
    name: str = Field("", description="reported by GetModelInfo; default: the target directory's name")


class EngineSettings(_Strict):
    """The engine knobs of every replica (see ``dspine.replica.EngineConfig``)."""

    max_concurrency: int = Field(8, ge=1, le=8, description="requests in flight per replica (also Serve's "
                                                             "max_ongoing_requests); the released plugin allows 8")
    max_seq_len: int | None = Field(None, ge=2, description="prompt + output per request; None: the target's limit")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the drafter's dtype; auto: the target's. It changes what is proposed, never what is "
                            "emitted")
    verify_threshold: float | None = Field(None, ge=0.0, lt=1.0, description="None: the engine's default")
    retrieval: Literal["auto", "exact", "fp8", "bf16"] = "auto"
    num_threads: int | None = Field(None, ge=1, description="torch threads per replica; None: the replica's num_cpus")
    device_memory: str | None = Field(None, description="device memory the start-up memory plan checks against "
                                                        "(e.g. 141GB, 139GiB); None: detected")
    prefill_chunk_tokens: int = Field(4096, ge=1, description="prompt tokens prefilled per step (chunked prefill)")
    target_kv_tokens: int | None = Field(None, ge=1, description="target K/V positions admission hands out; "
                                                                 "None: unbounded")
    admission_reservation: Literal["max_new_tokens", "prompt"] = Field(
        "max_new_tokens", description="tokens a request reserves per pool: prompt + max_new_tokens, or prompt + "
                                      "one block")
    admission_when_full: Literal["queue", "refuse"] = Field(
        "queue", description="a request that does not fit a pool now waits in the engine or is refused "
                             "(RESOURCE_EXHAUSTED)")
    adaptive_speculation: bool = Field(True, description="choose per request and step how many draft rows to "
                                                         "verify, or to decode target-only, from measured costs; "
                                                         "false: draft every step")
    sampled_draft_min_temperature: float = Field(0.3, gt=0.0, description="with a sampled drafter loaded "
                                                 "(model.sampled_draft_dir), requests with temperature >= this "
                                                 "draft with it, the others with the greedy one")

    @field_validator("device_memory")
    @classmethod
    def _device_memory(cls, v: str | None) -> str | None:
        if v is not None:
            from dspine.replica.memory_plan import parse_size

            if parse_size(v) < 1:  # a bad size raises ValueError naming device_memory
                raise ValueError("device_memory: must be > 0 bytes")
        return v

    def engine_config(self, num_threads: int | None):
        """The replica's frozen ``EngineConfig``."""
        from dspine.replica import EngineConfig

        knobs: dict[str, Any] = dict(max_concurrency=self.max_concurrency, max_seq_len=self.max_seq_len,
                                     device=self.device, dtype=self.dtype, draft_dtype=self.draft_dtype,
                                     retrieval=self.retrieval,
                                     num_threads=self.num_threads or num_threads,
                                     prefill_chunk_tokens=self.prefill_chunk_tokens,
                                     target_kv_tokens=self.target_kv_tokens,
                                     admission_reservation=self.admission_reservation,
                                     admission_when_full=self.admission_when_full,
                                     adaptive_speculation=self.adaptive_speculation,
                                     sampled_draft_min_temperature=self.sampled_draft_min_temperature)
        if self.device_memory is not None:
            from dspine.replica.memory_plan import parse_size

            knobs["device_memory"] = parse_size(self.device_memory)
        if self.verify_threshold is not None:
            knobs["verify_threshold"] = self.verify_threshold
        return EngineConfig(**knobs)


class AutoscalingSettings(_Strict):
    """Serve autoscaling of the engine replicas (replaces a fixed ``num_replicas``)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(6.0, gt=0, description="per replica; at most max_concurrency")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling: min_replicas must be <= max_replicas")
        return self


class ReplicaSettings(_Strict):
    """How many engine replicas, what each gets, how long they may take."""

    num_replicas: int = Field(1, ge=1, description="fixed replica count (ignored with autoscaling)")
    autoscaling: AutoscalingSettings | None = None
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica (also its torch threads on CPU)")
    num_gpus: float = Field(0.0, ge=0, le=1, description="1 on GPU clusters: one GPU per replica, TP=1")
    max_queued_requests: int = Field(16, ge=0, description="requests waiting for a free slot, per caller "
                                                           "(the ingress); beyond it RESOURCE_EXHAUSTED")
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    stall_timeout_s: float = Field(60.0, gt=0, description="a replica with work and no finished step for this "
                                                           "long reports unhealthy and is replaced")
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0, description="in-flight requests may finish this long")
    routing_stats_period_s: float = Field(1.0, gt=0, description="how often replicas report their load")


class IngressSettings(_Strict):
    """The gRPC-facing deployment in front of the engine replicas."""

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, gt=0)
    # A request whose replica died before its first token is sent once more, elsewhere.
    retry_unstarted: bool = True
    auth_token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                       description="environment variable holding a bearer token that every call "
                                                   "must send (authorization: Bearer ...); Serve's proxy has no auth")


class ClusterConfig(_Strict):
    """The whole cluster: models, engine knobs, replicas, ingress, gRPC endpoint."""

    app_name: str = Field("dspine", pattern=r"^[A-Za-z0-9_-]+$")
    grpc_port: int = Field(9000, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535, description="Serve's HTTP proxy (health probes)")
    request_timeout_s: float | None = Field(300.0, gt=0, description="end to end, queueing included; "
                                                                      "then DEADLINE_EXCEEDED")
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger gRPC messages get "
                                   "RESOURCE_EXHAUSTED (the proxy's RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, set on "
                                   "every node's environment)")
    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    replicas: ReplicaSettings = ReplicaSettings()
    ingress: IngressSettings = IngressSettings()

    @model_validator(mode="after")
    def _autoscaling_target(self) -> "ClusterConfig":
        scaling = self.replicas.autoscaling
        if scaling is not None and scaling.target_ongoing_requests > self.engine.max_concurrency:
            raise ValueError("replicas.autoscaling.target_ongoing_requests: must be <= engine.max_concurrency "
                             f"({self.engine.max_concurrency})")
        return self

    # ------------------------------------------------------------ derived
    @property
    def replica_threads(self) -> int:
        """torch threads of one engine replica."""
        return self.engine.num_threads or max(1, int(self.replicas.num_cpus))

    def engine_deployment_options(self) -> dict[str, Any]:
        """``serve.deployment`` options of the engine replicas."""
        from ray.serve.config import RequestRouterConfig

        r = self.replicas
        options: dict[str, Any] = dict(
            name=ENGINE_DEPLOYMENT,
            max_ongoing_requests=self.engine.max_concurrency,
            # The bound that binds is the ingress's (dspine.cluster.admission); Serve's counts
            # requests still being routed too, so it is only a backstop, one full cluster above.
            max_queued_requests=r.max_queued_requests + self.max_engine_replicas * self.engine.max_concurrency,
            health_check_period_s=r.health_check_period_s,
            health_check_timeout_s=r.health_check_timeout_s,
            graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
            graceful_shutdown_wait_loop_s=0.5,
            ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus,
                               "runtime_env": {"env_vars": dict(_REPLICA_ENV)}},
            request_router_config=RequestRouterConfig(
                request_router_class="dspine.cluster.router:FreeCapacityRouter",
                request_routing_stats_period_s=r.routing_stats_period_s,
                request_routing_stats_timeout_s=max(1.0, r.routing_stats_period_s),
            ),
        )
        if r.autoscaling is None:
            options["num_replicas"] = r.num_replicas
        else:
            a = r.autoscaling
            options["autoscaling_config"] = dict(
                min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                target_ongoing_requests=a.target_ongoing_requests,
                upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s)
        return options

    @property
    def max_engine_replicas(self) -> int:
        scaling = self.replicas.autoscaling
        return scaling.max_replicas if scaling else self.replicas.num_replicas

    @property
    def initial_engine_replicas(self) -> int:
        scaling = self.replicas.autoscaling
        return max(scaling.min_replicas, 1) if scaling else self.replicas.num_replicas

    def ingress_deployment_options(self) -> dict[str, Any]:
        """``serve.deployment`` options of the ingress: it holds every request of the cluster,
        queued ones included, so its own cap is never the one that binds."""
        r = self.replicas
        per_ingress = (self.max_engine_replicas * self.engine.max_concurrency + r.max_queued_requests) * 2
        return dict(name=INGRESS_DEPLOYMENT, num_replicas=self.ingress.num_replicas,
                    max_ongoing_requests=max(per_ingress, 16), max_queued_requests=-1,
                    graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
                    ray_actor_options={"num_cpus": self.ingress.num_cpus,
                                       "runtime_env": {"env_vars": dict(_REPLICA_ENV)}})

    def grpc_options(self) -> dict[str, Any]:
        """Serve's ``grpc_options`` for this cluster."""
        options: dict[str, Any] = {"port": self.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]}
        if self.request_timeout_s is not None:
            options["request_timeout_s"] = self.request_timeout_s
        return options

    def node_environment(self) -> dict[str, str]:
        """Environment every Ray node needs for this config (read by Serve's proxy at start)."""
        return {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(self.max_message_bytes)}

    def serve_config(self) -> dict[str, Any]:
        """A serve-config document (``serve deploy`` / ``serve run``) for this cluster."""
        return {
            "proxy_location": "EveryNode",
            "http_options": {"host": "0.0.0.0", "port": self.http_port},
            "grpc_options": self.grpc_options(),
            "applications": [{
                "name": self.app_name,
                "route_prefix": "/" + self.app_name,
                "import_path": APP_IMPORT_PATH,
                "args": self.model_dump(mode="json", exclude_defaults=True),
            }],
        }
