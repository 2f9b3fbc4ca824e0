"""Compile builders, one module per backend: `compile/builders/<backend with '-' as '_'>.py` defines
`build(checkpoint_dir, staging_dir, spec, llama)`, which writes `weights/` and `compiled/` under
`staging_dir`, and optionally `check(llama, spec)`, which rejects what the backend cannot build before any
work starts. `llama` is the checkpoint as `check_checkpoint` validated it once: builders never read or
validate the checkpoint again. Adding a backend's builder is adding its module; nothing here changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from app.backends.base import BackendSpec
from app.errors import ConfigError
from app.llama import LlamaSpec


@dataclass(frozen=True, slots=True)
class Builder:
    backend: str
    build: Callable[[Path, Path, BackendSpec, LlamaSpec], None]
    check: Callable[[LlamaSpec, BackendSpec], None]


def _no_check(llama: LlamaSpec, spec: BackendSpec) -> None:
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
