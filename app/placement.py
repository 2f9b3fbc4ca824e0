"""NeuronCore placement: parsing `NEURON_RT_VISIBLE_CORES` and cutting the visible cores into replica groups.

The runtime documents four forms (aws-neuron-sdk v2.28.0, research/neuron-signatures.md "(e)"): one index
(`0`), an inclusive range (`0-2`), a comma list (`3,4,5,6`, what the Kubernetes device plugin exports
for a pod) and a mix (`3-5,6`). Indices are node-global and must come in increasing order, and the
cores one runtime gets must form one contiguous range (`3,5,6` is invalid). A tp-N model gets exactly
N cores. Replicas cut the visible cores, in order, into groups of N; each group must be contiguous on
its own, so a device plugin that hands a pod `0,1,4,5` still yields two tp-2 replicas. A group is passed
to its process in the range form (`4-5`), which every runtime version reads.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from app.errors import ConfigError

CORES_VARIABLE = "NEURON_RT_VISIBLE_CORES"
CORES_PER_DEVICE = 2  # Inf2 (and Trn1): two NeuronCores per /dev/neuron<d>
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cores(value: str) -> tuple[int, ...]:
    """The core ids a `NEURON_RT_VISIBLE_CORES` value names, in order: '3-5,6' -> (3, 4, 5, 6)."""
    cores: list[int] = []
    for item in value.split(","):
        match = _ITEM.match(item.strip())
        if match is None:
            raise ConfigError(
                f"{CORES_VARIABLE}={value!r}: {item.strip()!r} is not a core index or an inclusive range "
                "(forms: '0', '0-2', '3,4,5,6', '3-5,6')"
            )
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ConfigError(f"{CORES_VARIABLE}={value!r}: the range {item.strip()!r} ends before it starts")
        cores.extend(range(first, last + 1))
    for before, after in itertools.pairwise(cores):
        if after <= before:
            raise ConfigError(
                f"{CORES_VARIABLE}={value!r}: core indices must increase (core {after} comes after {before})"
            )
    return tuple(cores)


def check_group(cores: tuple[int, ...], tp_degree: int, source: str) -> None:
    """One runtime's cores: exactly `tp_degree` of them, contiguous."""
    if len(cores) != tp_degree:
        raise ConfigError(
            f"{source} names {len(cores)} NeuronCores but the artifact is compiled for tp_degree "
            f"{tp_degree}: give it exactly {tp_degree}"
        )
    if cores[-1] - cores[0] != len(cores) - 1:
        raise ConfigError(
            f"{source} names cores {format_cores(cores, ranges=False)}, which are not contiguous: the "
            "Neuron runtime needs one contiguous range per process"
        )


def format_cores(cores: tuple[int, ...], ranges: bool = True) -> str:
    """A contiguous group in range form ('4-5', or '4' alone); `ranges=False`: a comma list."""
    if not ranges or cores[-1] - cores[0] != len(cores) - 1:
        return ",".join(map(str, cores))
    return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"


def replica_groups(cores: tuple[int, ...], tp_degree: int, replicas: int | None) -> list[tuple[int, ...]]:
    """Cut the visible cores, in order, into `replicas` groups of `tp_degree` (None: as many as fit)."""
    count = len(cores) // tp_degree if replicas is None else replicas
    if count < 1 or count * tp_degree > len(cores):
        raise ConfigError(
            f"{count or 'no'} replica(s) of tp_degree {tp_degree} need {max(count, 1) * tp_degree} "
            f"NeuronCores but {len(cores)} are visible ({format_cores(cores, ranges=False)})"
        )
    groups = [cores[i * tp_degree : (i + 1) * tp_degree] for i in range(count)]
    for index, group in enumerate(groups):
        check_group(group, tp_degree, f"replica {index}'s core group")
    return groups


def instance_cores(dev: Path = Path("/dev")) -> tuple[int, ...]:
    """Every NeuronCore of the host's Neuron devices (none where there are none)."""
    devices = [p for p in dev.glob("neuron*") if p.name[len("neuron") :].isdigit()]
    return tuple(range(len(devices) * CORES_PER_DEVICE))


def replica_devices(device: str, replicas: str, tp_degree: int, visible_cores: str | None) -> list[str]:
    """The backend `device` of each replica: on neuron, `neuron:<group>` for each contiguous group of
    `tp_degree` cores among those the device setting, else `visible_cores`, else the instance names;
    elsewhere the same device for each (`auto` is one replica off neuron)."""
    count = None if replicas == "auto" else int(replicas)
    prefix, _, pinned = device.partition(":")
    if prefix != "neuron":
        return [device] * (count or 1)
    value = pinned or visible_cores
    cores = parse_cores(value) if value else instance_cores()
    if count == 1 and not pinned and not value:
        return [device]  # one replica, placement left to the runtime (NEURON_RT_NUM_CORES)
    return [f"neuron:{format_cores(group)}" for group in replica_groups(cores, tp_degree, count)]
