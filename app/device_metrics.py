"""Device metrics in the server's own `/metrics`: per-NeuronCore utilization, device memory used,
execution errors and latency, each under the `replica` label of the engine whose runtime reported it.

Where `neuron-monitor` is on PATH, the server runs it as a child process with a config limited to its own
runtimes (`tag_filter`) and parses the JSON report it prints once per period, labelling utilization
`source="neuron-monitor"`. A runtime names itself by its process's `NEURON_PROCESS_TAG`, else its PID.
The single engine runs in the server's process: its tag is that process's (`runtime_tag`). Each replica
process sets its own tag before its runtime starts (`replica_tag`: the server's tag and the replica's
index), so the monitor tells the replicas' NeuronCores apart (`runtime_tags`). Elsewhere, or if the
monitor exits, the same utilization gauge carries each engine's busy fraction
(`inf2serve_engine_busy_ratio`) as core "all", `source="engine"`.

For the server: `DeviceMetrics.for_backend(spec.backend, runtime_tags).start()` inside the running event
loop (the lifespan), and `await device_metrics.stop()` at shutdown, which also ends the child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import metrics

RuntimeTags = Mapping[str, str]  # a runtime's NEURON_PROCESS_TAG (or PID) -> its engine's replica label

log = logging.getLogger(__name__)

MONITOR = "neuron-monitor"
SOURCE_MONITOR = "neuron-monitor"
SOURCE_ENGINE = "engine"
ENGINE_CORE = "all"
RUNTIME_GROUPS = ("neuroncore_counters", "memory_used", "execution_stats")
MAX_REPORT_BYTES = 16 * 1024 * 1024  # one report is one line; a 24-core host's is well under this
STOP_TIMEOUT_S = 5.0
TAG_VARIABLE = "NEURON_PROCESS_TAG"


@dataclass(frozen=True, slots=True)
class RuntimeReport:
    """One period of one runtime's counters, as neuron-monitor reported them."""

    utilization: dict[str, float] = field(default_factory=dict)  # core -> 0..1
    flops: dict[str, float] = field(default_factory=dict)  # core -> FLOPs in the period
    memory: dict[tuple[str, str], float] = field(default_factory=dict)  # (core, category) -> bytes
    errors: dict[str, float] = field(default_factory=dict)  # error type -> count in the period
    latency: dict[str, float] = field(default_factory=dict)  # percentile -> seconds


def runtime_tag() -> str:
    """How this process's Neuron runtime names itself to neuron-monitor."""
    return os.environ.get(TAG_VARIABLE) or str(os.getpid())


def replica_tag(server_tag: str, index: int) -> str:
    """The tag a replica process gives its runtime (set in its environment before the runtime starts)."""
    return f"{server_tag}-replica{index}"


def monitor_config(tags: RuntimeTags, period_s: float) -> dict[str, Any]:
    """A neuron-monitor config that collects only these runtimes' groups, nothing system-wide."""
    names = "|".join(re.escape(tag) for tag in sorted(tags))
    return {
        "period": f"{period_s:g}s",
        "neuron_runtimes": [
            {"tag_filter": f"^({names})$", "metrics": [{"type": group} for group in RUNTIME_GROUPS]}
        ],
        "system_metrics": [],
    }


def parse_report(document: Mapping[str, Any], tags: RuntimeTags) -> dict[str, RuntimeReport]:
    """Our runtimes' counters from one neuron-monitor report, by replica label (none: the report has
    none of them). A runtime, or a metric group, whose `error` is set is left out."""
    reports = {}
    for runtime in document.get("neuron_runtime_data") or ():
        names = (str(runtime.get("neuron_runtime_tag")), str(runtime.get("pid")))
        replica = next((tags[name] for name in names if name in tags), None)
        if replica is not None and not runtime.get("error"):
            reports[replica] = _runtime_report(runtime.get("report") or {})
    return reports


def _runtime_report(report: Mapping[str, Any]) -> RuntimeReport:
    groups = {name: group for name, group in report.items() if not group.get("error")}
    return RuntimeReport(
        **_cores(groups.get("neuroncore_counters", {})),
        memory=_memory(groups.get("memory_used", {})),
        **_execution(groups.get("execution_stats", {})),
    )


def _cores(counters: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    utilization, flops = {}, {}
    for core, values in (counters.get("neuroncores_in_use") or {}).items():
        utilization[core] = float(values["neuroncore_utilization"]) / 100.0
        # Documented as `flops`; runtimes seen on inf2 print `effective_flops`.
        counted = values.get("flops", values.get("effective_flops"))
        if counted is not None:
            flops[core] = float(counted)
    return {"utilization": utilization, "flops": flops}


def _memory(used: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    totals = used.get("neuron_runtime_used_bytes") or {}
    memory = {("all", "total"): float(totals["neuron_device"])} if "neuron_device" in totals else {}
    per_core = (totals.get("usage_breakdown") or {}).get("neuroncore_memory_usage") or {}
    for core, categories in per_core.items():
        memory.update({(core, category): float(value) for category, value in categories.items()})
    return memory


def _execution(stats: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    errors = {kind: float(count) for kind, count in (stats.get("error_summary") or {}).items()}
    latency = (stats.get("latency_stats") or {}).get("total_latency") or {}  # null while idle
    return {"errors": errors, "latency": {p: float(s) for p, s in latency.items() if s is not None}}


def record_report(report: RuntimeReport, replica: str) -> None:
    for core, ratio in report.utilization.items():
        metrics.record_core_utilization(core, ratio, SOURCE_MONITOR, replica)
    for core, flops in report.flops.items():
        metrics.record_core_flops(core, flops, replica)
    for (core, category), size in report.memory.items():
        metrics.record_device_memory(core, category, size, replica)
    for kind, count in report.errors.items():
        metrics.record_execution_errors(kind, count, replica)
    for percentile, seconds in report.latency.items():
        metrics.record_execution_latency(percentile, seconds, replica)


class DeviceMetrics:
    """Keeps the device gauges current: neuron-monitor's reports where it runs, else the engine's."""

    def __init__(
        self,
        monitor_path: str | None,
        period_s: float = 5.0,
        tags: RuntimeTags | None = None,
        busy_fractions: Callable[[], Mapping[str, float]] = metrics.engine_busy_ratios,
    ) -> None:
        """`tags`: the runtimes to report (default: this process's, as replica "0"); `busy_fractions`:
        each engine's busy fraction by replica label, for the fallback."""
        self.monitor_path = monitor_path
        self.period_s = period_s
        self.tags = tags or {runtime_tag(): metrics.SINGLE_REPLICA}
        self.busy_fractions = busy_fractions
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_backend(cls, backend: str, tags: RuntimeTags | None = None) -> DeviceMetrics:
        """neuron-monitor for a Neuron backend on a host that has it; the engine's busy time otherwise."""
        return cls(shutil.which(MONITOR) if backend.startswith("neuron-") else None, tags=tags)

    def start(self) -> None:
        """Begin in the background; call from inside the running event loop."""
        self._task = asyncio.create_task(self._run(), name="inf2serve-device-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._end_monitor()

    async def _run(self) -> None:
        if self.monitor_path:
            await self._follow_monitor(self.monitor_path)
            log.warning("neuron-monitor exited; NeuronCore utilization now comes from the engine's busy time")
        while True:
            ratios = self.busy_fractions()
            for replica in self.tags.values():
                metrics.record_core_utilization(ENGINE_CORE, ratios.get(replica, 0.0), SOURCE_ENGINE, replica)
            await asyncio.sleep(self.period_s)

    async def _follow_monitor(self, path: str) -> None:
        with tempfile.TemporaryDirectory(prefix="inf2serve-monitor-") as scratch:
            config = Path(scratch) / "neuron-monitor.json"
            config.write_text(json.dumps(monitor_config(self.tags, self.period_s)))
            try:
                self._process = await asyncio.create_subprocess_exec(
                    path,
                    "-c",
                    str(config),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    limit=MAX_REPORT_BYTES,
                )
            except OSError as error:
                log.warning("cannot start %s: %s", path, error)
                return
            assert self._process.stdout is not None
            async for line in self._process.stdout:
                self._consume(line)
            await self._process.wait()

    def _consume(self, line: bytes) -> None:
        try:
            reports = parse_report(json.loads(line), self.tags)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("skipping an unreadable neuron-monitor report: %s", error)
            return
        for replica, report in reports.items():
            record_report(report, replica)

    async def _end_monitor(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
