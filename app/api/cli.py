"""`inf2serve serve` (and the bare `serve` SageMaker runs): one flag per `ServerSettings` field.

Flags are generated from the settings model, so flags and `INF2SERVE_*` variables never drift apart;
a flag given wins over its variable. API keys come only from the environment or a file (a flag would
show them in `ps`).
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import ValidationError

from app.errors import ConfigError
from app.settings import ServerSettings

_NOT_FLAGS = frozenset({"api_keys"})


def _flag_type(annotation: Any) -> Any:
    """`int | None` -> int; str, int, float, bool and Path are the types settings use."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation if annotation in (str, int, float, bool, Path) else str


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve one artifact over HTTP (OpenAI API, SageMaker contract, /metrics)",
        description="Flags override INF2SERVE_<NAME> variables; SAGEMAKER_BIND_TO_PORT sets the port.",
        allow_abbrev=False,
    )
    for name, field in ServerSettings.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        kind = _flag_type(field.annotation)
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or name} (default: {field.default})"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, help=help_text)
    parser.set_defaults(handler=run)


def settings_from(args: argparse.Namespace) -> ServerSettings:
    """The flags given (those left unset fall back to the environment, then the defaults)."""
    given = {name: value for name, value in vars(args).items() if name in ServerSettings.model_fields}
    return ServerSettings(**{name: value for name, value in given.items() if value is not None})


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValidationError as error:
        print(f"inf2serve serve: invalid settings: {error}", file=sys.stderr)
        return 2
    except ConfigError as error:
        print(f"inf2serve serve: invalid settings: {error.message}", file=sys.stderr)
        return 2
    # NOTE: imported here so that other subcommands (`inf2serve compile`) do not load uvicorn and FastAPI.
    from app.api.server import serve

    return serve(settings)
