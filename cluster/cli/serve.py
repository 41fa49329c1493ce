"""``dspine serve`` (a Ray Serve cluster, or ``--standalone``: one engine, no Ray), ``dspine status``
and ``dspine deploy``: running the gRPC API and looking after a running cluster."""

from __future__ import annotations

import json
import sys

from .options import add_model_args, engine_config


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the gRPC API on a Ray Serve cluster (--standalone: one "
                                              "engine, no Ray)")
    add_model_args(serve)
    serve.add_argument("--standalone", action="store_true", help="one engine in this process, no Ray")
    serve.add_argument("--host", default="127.0.0.1", help="--standalone: interface to bind")
    serve.add_argument("--port", type=int, default=None,
                       help="gRPC port (default: 9000 for the cluster, 50051 standalone; 0: any free port, "
                            "standalone only)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight per replica (default 8)")
    serve.add_argument("--replicas", type=int, default=None, help="engine replicas (cluster; default 1)")
    serve.add_argument("--num-cpus", type=float, default=None,
                       help="CPUs (and torch threads) per replica (cluster; default 1)")
    serve.add_argument("--num-gpus", type=float, default=None, help="GPUs per replica (cluster; 1 on GPU nodes)")
    serve.add_argument("--max-queued", type=int, default=None,
                       help="requests that may wait for a slot before RESOURCE_EXHAUSTED (cluster)")
    serve.add_argument("--request-timeout", type=float, default=None, help="seconds, queueing included (cluster)")
    serve.add_argument("--http-port", type=int, default=None, help="Serve's HTTP proxy port (cluster)")
    serve.add_argument("--config", help="a serve-config YAML whose dspine application's args are the base "
                                        "(flags override them)")
    serve.add_argument("--address", help="join this Ray cluster (e.g. auto) instead of starting a local one; "
                                         "deploys and returns")
    serve.add_argument("--max-seq-len", type=int, default=None, help="context (prompt + output) per request")
    serve.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: TLS)")
    serve.add_argument("--tls-key", help="PEM private key")
    serve.add_argument("--auth-token", help="require 'authorization: Bearer TOKEN' on every call")

    status = commands.add_parser("status", help="the cluster's replicas: load, peak in flight, health")
    status.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    status.add_argument("--app", default="dspine", help="application name")
    status.add_argument("--json", action="store_true")

    deploy = commands.add_parser("deploy", help="strictly check a serve-config YAML, then `serve deploy` it")
    deploy.add_argument("config", help="serve-config YAML (e.g. the shipped cluster/serve_config.yaml)")
    deploy.add_argument("--check", action="store_true", help="only check, do not deploy")
    deploy.add_argument("--address", help="Ray dashboard address for serve deploy (default: its own)")
    serve.set_defaults(handler=cmd_serve)
    status.set_defaults(handler=cmd_status)
    deploy.set_defaults(handler=cmd_deploy)


def cluster_config_from_args(args):
    """The :class:`ClusterConfig` of ``dspine serve``: the --config file's args (or the defaults),
    with the flags given on top."""
    from ..config import ClusterConfig
    from ..serve_config import cluster_config_of, load_serve_config

    base = cluster_config_of(load_serve_config(args.config)) if args.config else ClusterConfig()
    data = base.model_dump()
    for flag, key in (("port", "grpc_port"), ("http_port", "http_port"), ("request_timeout", "request_timeout_s")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    if args.target is not None:
        data["model"].update(target_dir=args.target, draft_dir=args.draft, sampled_draft_dir=args.sampled_draft)
    elif args.draft is not None:
        data["model"].update(draft_dir=args.draft, sampled_draft_dir=args.sampled_draft)
    elif args.sampled_draft is not None:
        data["model"]["sampled_draft_dir"] = args.sampled_draft
    engine = data["engine"]
    for key in ("sampled_draft_min_temperature", "max_concurrency", "max_seq_len"):
        if getattr(args, key) is not None:
            engine[key] = getattr(args, key)
    for flag, key in (("device", "device"), ("dtype", "dtype"), ("draft_dtype", "draft_dtype"),
                      ("retrieval", "retrieval")):
        if getattr(args, flag) != "auto":
            engine[key] = getattr(args, flag)
    if args.verify_threshold is not None:
        engine["verify_threshold"] = args.verify_threshold
    replicas = data["replicas"]
    for flag, key in (("replicas", "num_replicas"), ("num_cpus", "num_cpus"), ("num_gpus", "num_gpus"),
                      ("max_queued", "max_queued_requests")):
        if getattr(args, flag) is not None:
            replicas[key] = getattr(args, flag)
    return ClusterConfig.model_validate(data)


def cmd_serve_cluster(args) -> int:
    import signal
    import threading

    from ..launch import start_cluster

    if args.port == 0:
        raise ValueError("--port 0 is for --standalone; Serve's gRPC proxy needs a fixed port")
    if args.tls_cert or args.tls_key or args.auth_token:
        raise ValueError("--tls-cert/--tls-key/--auth-token are for --standalone: Serve's gRPC proxy has no TLS "
                         "or auth; terminate them in front of the cluster (see README)")
    config = cluster_config_from_args(args)
    print(f"dspine: starting the cluster ({config.replicas.num_replicas} engine replicas)...", file=sys.stderr,
          flush=True)
    start_cluster(config, address=args.address)
    endpoint = f"127.0.0.1:{config.grpc_port}"
    print(f"dspine: cluster serving dspine.v1 on {endpoint}", flush=True)
    print(f"  try: dspine generate --server {endpoint} --prompt 'def fibonacci(n):' --max-new-tokens 64", flush=True)
    print("  status: dspine status", flush=True)
    if args.address:
        return 0  # the cluster outlives this command
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    from ray import serve

    print("dspine: shutting down (in-flight requests may finish)", file=sys.stderr, flush=True)
    serve.shutdown()
    return 0


def cmd_status(args) -> int:
    from ..launch import SERVE_NAMESPACE, format_status, replica_loads, use_ray_token_auth

    use_ray_token_auth()  # before Ray is imported: it reads RAY_AUTH_MODE once
    import ray
    from ray import serve

    ray.init(address=args.address, namespace=SERVE_NAMESPACE, log_to_driver=False, logging_level="ERROR")
    applications = serve.status().applications
    app = applications.get(args.app)
    app_status = app.status.value if app is not None else "NOT DEPLOYED"
    loads = replica_loads(args.app)
    if args.json:
        print(json.dumps({"application": args.app, "status": app_status, "replicas": loads}, indent=2))
    else:
        print(format_status(args.app, app_status, loads))
    return 0 if app is not None else 1


def cmd_deploy(args) -> int:
    from ..launch import serve_deploy
    from ..serve_config import load_serve_config

    load_serve_config(args.config)  # raises ValueError naming every bad key
    print(f"{args.config}: ok", file=sys.stderr)
    return 0 if args.check else serve_deploy(args.config, args.address)


def cmd_serve(args) -> int:
    if not args.standalone:
        return cmd_serve_cluster(args)
    import asyncio
    from pathlib import Path

    from dspine.replica import Engine
    from dspine.replica.gc_freeze import freeze_after_load

    from ..server import ServerConfig, serve_forever
    from .options import model_dirs_from_args

    target_dir, draft_dir, sampled_draft_dir = model_dirs_from_args(args, speculative_needed=False)
    config = ServerConfig(host=args.host, port=50051 if args.port is None else args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          auth_token=args.auth_token, model_name=Path(target_dir).name)
    engine = Engine.from_pretrained(target_dir, draft_dir, engine_config(
        args, max_concurrency=args.max_concurrency or 8, max_seq_len=args.max_seq_len),
        sampled_draft_dir=sampled_draft_dir)
    freeze_after_load()
    asyncio.run(serve_forever(engine, config))
    return 0

