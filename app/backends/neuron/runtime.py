"""What a Neuron backend needs from its host: the library (imported on demand, with one clear error when
it is missing), the versions of the Neuron stack (recorded in the manifest at compile time, compared at
load: each backend's `pinned_versions`), and the NeuronCores this process may use.

Core placement: the Neuron runtime reads `NEURON_RT_VISIBLE_CORES` (every documented form is parsed by
`app/placement.py`) or `NEURON_RT_NUM_CORES` once, when the first model is loaded in the process, so
placement is applied to the environment just before loading. A tp-N artifact gets exactly N contiguous
cores (whether a compiled tp-N model tolerates more visible cores is unconfirmed), exported in range form.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from types import ModuleType

from app.errors import ConfigError
from app.placement import CORES_VARIABLE, check_group, format_cores, parse_cores

NEURON_PIP_REPOSITORY = "https://pip.repos.neuron.amazonaws.com"

# The runtime is an OS package (libnrt), not a wheel: `runtime_version` probes it.
RUNTIME_PACKAGE = "aws-neuronx-runtime-lib"
# The stack a Neuron artifact records and the server must match, per backend (`Backend.pinned_versions`):
# the compiler that built the NEFFs, the PyTorch bridge, the library that traced and runs the graphs
# (whole versions), and the runtime that loads them (X.Y.Z.W: a Debian package version carries a build
# suffix that RPM's does not).
COMMON_PINS: dict[str, int | None] = {"neuronx-cc": None, "torch-neuronx": None, RUNTIME_PACKAGE: 4}
NXDI_PINS: dict[str, int | None] = {
    **COMMON_PINS,
    "neuronx-distributed": None,
    "neuronx-distributed-inference": None,
}
TNX_PINS: dict[str, int | None] = {**COMMON_PINS, "transformers-neuronx": None}

_NUMERIC_VERSION = re.compile(r"^(?:\d+:)?(\d+(?:\.\d+)*)")


def import_library(module: str, backend: str) -> ModuleType:
    """Import a Neuron module, or fail with the one error that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"backend {backend} needs {module!r}, which cannot be imported ({exc}). Install the Neuron "
            f"extra on a Neuron host: pip install '.[{backend}]' --extra-index-url {NEURON_PIP_REPOSITORY} "
            "(never from PyPI, where these names are placeholders); see README, 'Neuron stack'"
        ) from exc


def runtime_version() -> str | None:
    """The installed Neuron runtime package's numeric version (Debian or RPM), or None where there is
    none: `2.30.51.0` from a package version such as `2.30.51.0-f7e3c8a1b` (build suffix and any epoch
    dropped), so an artifact compiled against one build of a release matches another build of it."""
    queries = (
        ("dpkg-query", "-W", "-f=${Version}", RUNTIME_PACKAGE),
        ("rpm", "-q", "--qf", "%{VERSION}", RUNTIME_PACKAGE),
    )
    for query in queries:
        if shutil.which(query[0]) is None:
            continue
        result = subprocess.run(query, capture_output=True, text=True, timeout=10, check=False)
        if result.returncode == 0 and (numeric := _NUMERIC_VERSION.match(result.stdout.strip())):
            return numeric[1]
    return None


def visible_cores(device: str) -> str | None:
    """The cores a backend `device` setting names: `neuron:0-1` (or any `NEURON_RT_VISIBLE_CORES` form,
    `neuron:2,3`) pins them; `neuron` (or the settings default `cpu`) leaves placement to the environment."""
    if device in ("neuron", "cpu"):
        return None
    prefix, _, cores = device.partition(":")
    if prefix != "neuron" or not cores:
        raise ConfigError(
            f"device {device!r} is not a Neuron placement: use 'neuron' or 'neuron:<cores>' ('neuron:0-1')"
        )
    parse_cores(cores)
    return cores


def placement_env(visible_cores: str | None, tp_degree: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The runtime variables that place a tp-`tp_degree` model: the configured cores, else those the
    operator or the Kubernetes device plugin exported (a comma list there), else `NEURON_RT_NUM_CORES` so
    that the runtime picks free cores (which lets several servers share a host)."""
    value = visible_cores or environ.get(CORES_VARIABLE)
    if value is None:
        return {"NEURON_RT_NUM_CORES": str(tp_degree)}
    cores = parse_cores(value)
    check_group(cores, tp_degree, f"{CORES_VARIABLE}={value}")
    return {CORES_VARIABLE: format_cores(cores)}


def apply_placement(visible_cores: str | None, tp_degree: int) -> None:
    """Export the placement before the runtime starts."""
    os.environ.update(placement_env(visible_cores, tp_degree, os.environ))
