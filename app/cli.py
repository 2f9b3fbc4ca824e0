"""The one `inf2serve` command line.

Subcommands live with the code they drive and plug in through the `inf2serve.commands` entry-point
group (see pyproject.toml): each entry names a `register(subparsers)` function. That keeps the
dependency rule intact: `app/` never imports `compile/`, `deploy/` or `loadtest/`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from app import __version__

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inf2serve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"inf2serve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in sorted(entry_points(group="inf2serve.commands"), key=lambda e: e.name):
        entry.load()(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


def sagemaker_serve() -> int:
    """SageMaker starts the container as `docker run IMAGE serve`: the bare `serve` command."""
    return main(["serve", *sys.argv[1:]])
