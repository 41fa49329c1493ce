"""The ``dspine`` argument parser: one subcommand group per module, each registering its own flags
and handler (``args.handler``)."""

from __future__ import annotations

import argparse

from . import bench, generate, plan, serve, train


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``dspine`` command; ``parse_args(...).handler(args)`` runs the command."""
    parser = argparse.ArgumentParser(prog="dspine", description="DSpine speculative decoding serving stack")
    commands = parser.add_subparsers(dest="command", required=True)
    for group in (generate, serve, plan, bench, train):  # the order of `dspine --help`
        group.add_parser(commands)
    return parser
