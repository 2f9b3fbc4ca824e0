"""Backend registry: names to classes, imported lazily so that a missing device library (Neuron, CUDA)
only matters to the backend that needs it."""

from __future__ import annotations

from importlib import import_module

from app.backends.base import Backend
from app.errors import ConfigError

BACKENDS: dict[str, str] = {
    "torch": "app.backends.torch:TorchBackend",
    "sim": "app.backends.sim:SimBackend",
    "neuron-nxdi": "app.backends.neuron.nxdi:NxdiBackend",
    "neuron-tnx": "app.backends.neuron.tnx:TnxBackend",
}


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(import_module(module_name), class_name)
