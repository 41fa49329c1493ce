"""The ``dspine`` command line.

    dspine generate --prompt TEXT [--target DIR --draft DIR] [--no-spec] [--json] [--server HOST:PORT]
    dspine serve [--replicas N] [--port 9000] [--config FILE] [--address ADDR]   # the Ray Serve cluster
    dspine serve --standalone [--target DIR --draft DIR] [--host H --port P] [--max-concurrency N]
    dspine status [--address ADDR] [--app NAME] [--json]
    dspine deploy FILE [--check] [--address URL]
    dspine info --draft-preset dspine-27b-b16
    dspine plan [--target-preset NAME | --target DIR] [--draft-preset NAME | --draft DIR] [--device-memory 141GB]
                [--max-concurrency 8] [--max-seq-len 8192] [--draft-pool dense|ring]   # exit 1: does not fit
    dspine bench target | engine | prefill | cluster
    dspine train target | draft

Without ``--target`` the embedded tiny trained pair is used. Heavy imports
happen inside the command that needs them, so ``dspine --help`` is instant.

One module per command group (generate, serve: serve/status/deploy, plan: plan/info, bench,
train); options holds the flags and configs they share, parser assembles them, and ``main``
turns any request or argument error into one line and a non-zero exit.
"""

from __future__ import annotations

import sys

from .parser import build_parser
from .serve import cluster_config_from_args

__all__ = ["main", "build_parser", "cluster_config_from_args"]


def _is_request_error(exc: BaseException) -> bool:
    """An engine's InvalidRequestError (checked without importing the engine, which loads torch)."""
    if "dspine.replica.errors" not in sys.modules:
        return False
    from dspine.replica.errors import InvalidRequestError

    return isinstance(exc, InvalidRequestError)


def main(argv: list[str] | None = None) -> int:
    """Run ``dspine ARGV`` and return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Exception as e:  # a request's or a server's error is one line with exit 1, not a traceback
        from ..client_errors import DSpineClientError, Unavailable

        if isinstance(e, DSpineClientError):
            hint = f" (is a dspine server listening at {args.server}?)" if isinstance(e, Unavailable) and getattr(
                args, "server", None) else ""
            print(f"dspine {args.command}: error: {e}{hint}", file=sys.stderr)
            return 1
        if _is_request_error(e):  # an engine's field error, named as a server names it
            from ..errors import status_for

            code, message = status_for(e)
            print(f"dspine {args.command}: error: {code.name}: {message}", file=sys.stderr)
            return 1
        if isinstance(e, (ValueError, FileNotFoundError)):  # bad arguments or files
            print(f"dspine {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise
