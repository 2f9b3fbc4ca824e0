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


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: only the command it names is loaded (a plugin's imports, FastAPI for
    `deploy`, would cost every other command); the others are listed by name, for `--help`."""
    parser = argparse.ArgumentParser(prog="inf2serve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"inf2serve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    for entry in sorted(entry_points(group="inf2serve.commands"), key=lambda e: e.name):
        if entry.name == command:
            entry.load()(subparsers)
        else:
            subparsers.add_parser(entry.name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


def sagemaker_serve() -> int:
    """SageMaker starts the container as `docker run IMAGE serve`: the bare `serve` command."""
    return main(["serve", *sys.argv[1:]])
