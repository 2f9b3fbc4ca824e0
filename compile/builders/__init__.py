"""Compile builders, one module per backend: `compile/builders/<backend with '-' as '_'>.py` defines
`build(checkpoint_dir, staging_dir, spec)`, which writes `weights/` and `compiled/` under `staging_dir`,
and optionally `check(checkpoint_dir, spec)`, which rejects what the backend cannot build before any
work starts. Adding a backend's builder is adding its module; nothing here changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from app.backends.base import BackendSpec
from app.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Builder:
    backend: str
    build: Callable[[Path, Path, BackendSpec], None]
    check: Callable[[Path, BackendSpec], None]


def _no_check(checkpoint_dir: Path, spec: BackendSpec) -> None:
    """A builder without its own checks relies on the generic checkpoint checks."""


def builder_for(backend: str) -> Builder:
    module_name = f"{__name__}.{backend.replace('-', '_')}"
    try:
        module = import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise ConfigError(f"no compile builder for backend {backend!r} (no module {module_name})") from error
    return Builder(backend, module.build, getattr(module, "check", _no_check))
