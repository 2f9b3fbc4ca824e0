"""NeuronCore metrics from neuron-monitor, each under its engine's `replica` label, and the engine-busy
fallback.

Reports are built from neuron-monitor's documented schema (neuron-monitor user guide; the constructed
inf2.48xlarge example in ../shared/research/neuron-api.md section 6a), in both per-core variants: the
documented `flops` and the `effective_flops` that runtimes on inf2 print. The child-process tests run a
fake `neuron-monitor` (a script printing such reports) on this machine, which has no Neuron device."""

from __future__ import annotations

import asyncio
import copy
import json
import multiprocessing
import os
import re
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app import metrics
from app.device_metrics import (
    TAG_VARIABLE,
    DeviceMetrics,
    monitor_config,
    parse_report,
    record_report,
    replica_tag,
)
from app.replicas import worker
from app.replicas.messages import Failed
from app.settings import ServerSettings

TAG = "llama-r0"
LATENCY = {
    "p0": 0.0191,
    "p1": 0.0192,
    "p25": 0.0196,
    "p50": 0.0199,
    "p75": 0.0203,
    "p99": 0.1540,
    "p100": 0.1612,
}
CORE_MEMORY = {
    "constants": 2147483648,
    "model_code": 176285056,
    "model_shared_scratchpad": 268435456,
    "runtime_memory": 0,
    "tensors": 92274688,
}


def runtime_entry(pid: int, tag: str, flops_key: str, utilization: float, errors: int = 0) -> dict[str, Any]:
    cores = {
        str(c): {"neuroncore_utilization": utilization + c, flops_key: 910_000_000_000 + c} for c in range(2)
    }
    return {
        "pid": pid,
        "address": "",
        "neuron_runtime_tag": tag,
        "error": "",
        "report": {
            "neuroncore_counters": {"period": 1.000113182, "neuroncores_in_use": cores, "error": ""},
            "execution_stats": {
                "period": 1.030613214,
                "error_summary": {
                    "generic": 0,
                    "numerical": errors,
                    "transient": 0,
                    "model": 0,
                    "runtime": 0,
                    "hardware": 0,
                },
                "execution_summary": {
                    "completed": 412,
                    "completed_with_err": 0,
                    "completed_with_num_err": errors,
                    "timed_out": 0,
                    "incorrect_input": 0,
                    "failed_to_queue": 0,
                },
                "latency_stats": {"total_latency": dict(LATENCY), "device_latency": dict(LATENCY)},
                "error": "",
            },
            "memory_used": {
                "period": 1.00001,
                "neuron_runtime_used_bytes": {
                    "host": 2149580800,
                    "neuron_device": 21474836480,
                    "usage_breakdown": {
                        "host": {
                            "application_memory": 2148532224,
                            "constants": 0,
                            "dma_buffers": 1048576,
                            "tensors": 0,
                        },
                        "neuroncore_memory_usage": {"0": dict(CORE_MEMORY), "1": dict(CORE_MEMORY)},
                    },
                },
                "loaded_models": [],
                "error": "",
            },
            "neuron_runtime_vcpu_usage": {
                "period": 1.03,
                "vcpu_usage": {"user": 38.2, "system": 6.1},
                "error": "",
            },
        },
    }


def report(
    flops_key: str = "flops", utilization: float = 71.0, errors: int = 0, tag: str = TAG
) -> dict[str, Any]:
    """A whole neuron-monitor document: our runtime, another replica's, and the system groups."""
    return {
        "neuron_runtime_data": [
            runtime_entry(41873, tag, flops_key, utilization, errors),
            runtime_entry(41874, "llama-r1", flops_key, 5.0, errors=7),
        ],
        "system_data": {
            "neuron_hw_counters": {"period": 1.03, "neuron_devices": [], "error": ""},
            "vcpu_usage": {"period": 0.99, "average_usage": {"user": 12.4, "idle": 84.7}, "error": ""},
            "memory_info": {
                "period": 5.3,
                "memory_total_bytes": 790273982464,
                "memory_used_bytes": 61203623936,
                "swap_total_bytes": 0,
                "swap_used_bytes": 0,
                "error": "",
            },
        },
        "instance_info": {"instance_type": "inf2.48xlarge", "error": ""},
        "neuron_hardware_info": {
            "neuron_device_type": "inferentia2",
            "neuron_device_count": 12,
            "neuron_device_memory_size": 34359738368,
            "neuroncore_per_device_count": 2,
            "logical_neuroncore_config": 1,
            "error": "",
        },
    }


def sample(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(metrics.PREFIX + name, labels)


@pytest.mark.parametrize("flops_key", ["flops", "effective_flops"])
def test_parse_reads_our_runtime_in_either_flops_variant(flops_key: str) -> None:
    parsed = parse_report(report(flops_key), {TAG: "0"})["0"]
    assert parsed.utilization == pytest.approx({"0": 0.71, "1": 0.72})
    assert parsed.flops == {"0": 910_000_000_000.0, "1": 910_000_000_001.0}
    assert parsed.memory[("all", "total")] == 21474836480
    assert parsed.memory[("1", "model_code")] == 176285056
    assert parsed.errors["numerical"] == 0  # the other replica's 7 errors are not ours
    assert parsed.latency == LATENCY


def test_parse_matches_the_pid_when_no_tag_is_set() -> None:
    document = report(tag="")
    assert set(parse_report(document, {"41873": "0"})) == {"0"}
    assert parse_report(document, {"99999": "0"}) == {}


def test_parse_skips_groups_with_errors_and_idle_latency() -> None:
    document = report()
    ours = document["neuron_runtime_data"][0]["report"]
    ours["memory_used"]["error"] = "failed to read memory usage"
    ours["execution_stats"]["latency_stats"]["total_latency"] = None
    parsed = parse_report(document, {TAG: "0"})["0"]
    assert parsed.memory == {} and parsed.latency == {}
    assert parsed.utilization


def test_record_exports_through_our_metrics() -> None:
    before = sample("neuron_execution_errors_total", error_type="numerical", replica="0") or 0.0
    record_report(parse_report(report(utilization=40.0, errors=2), {TAG: "0"})["0"], "0")
    record_report(parse_report(report(utilization=50.0, errors=3), {TAG: "0"})["0"], "0")
    utilization = sample("neuroncore_utilization_ratio", core="1", source="neuron-monitor", replica="0")
    assert utilization == pytest.approx(0.51)
    assert sample("device_memory_used_bytes", core="0", category="tensors", replica="0") == 92274688
    assert sample("neuron_execution_errors_total", error_type="numerical", replica="0") == before + 5
    assert sample("neuron_execution_latency_seconds", percentile="p99", replica="0") == pytest.approx(0.154)
    assert sample("neuroncore_flops", core="0", replica="0") == 910_000_000_000


def test_each_replicas_runtime_is_reported_under_its_replica_label() -> None:
    """With replicas, each replica process tags its runtime (`replica_tag`); the monitor's report of
    both runtimes lands under the two replica labels, each with its own counters."""
    tags = {replica_tag("srv", 0): "0", replica_tag("srv", 1): "1"}
    document = report(tag=replica_tag("srv", 0))
    document["neuron_runtime_data"][1]["neuron_runtime_tag"] = replica_tag("srv", 1)
    parsed = parse_report(document, tags)
    assert parsed["0"].utilization == pytest.approx({"0": 0.71, "1": 0.72})
    assert parsed["1"].utilization == pytest.approx({"0": 0.05, "1": 0.06})
    assert parsed["1"].errors["numerical"] == 7
    for replica, runtime in parsed.items():
        record_report(runtime, replica)
    for replica, ratio in (("0", 0.71), ("1", 0.05)):
        labels = {"core": "0", "source": "neuron-monitor", "replica": replica}
        assert sample("neuroncore_utilization_ratio", **labels) == pytest.approx(ratio)
    (runtime,) = monitor_config(tags, 1.0)["neuron_runtimes"]
    assert re.fullmatch(runtime["tag_filter"], "srv-replica1") and not re.fullmatch(
        runtime["tag_filter"], "srv"
    )


def test_a_replica_names_its_runtime_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica process sets NEURON_PROCESS_TAG before its backend (and so its runtime) starts."""
    seen = []

    def start_engine(*args: Any, **kwargs: Any) -> None:
        seen.append(os.environ.get(TAG_VARIABLE))
        raise RuntimeError("no device here")

    monkeypatch.setenv(TAG_VARIABLE, "the-servers")  # restored after the test
    monkeypatch.setattr(worker, "start_engine", start_engine)
    monkeypatch.setattr(worker, "configure_logging", lambda level: None)
    monkeypatch.setattr(worker.signal, "signal", lambda *args: None)  # this is not a replica process
    monkeypatch.setattr(worker.Tokenizer, "from_dir", lambda path: None)
    ours, theirs = multiprocessing.Pipe()
    worker.run_replica(theirs, 1, SimpleNamespace(root=tmp_path), ServerSettings(), replica_tag("srv", 1))  # type: ignore[arg-type]
    assert seen == ["srv-replica1"]
    assert isinstance(ours.recv(), Failed)


def test_monitor_config_limits_collection_to_our_runtime() -> None:
    config = monitor_config({"inf2serve.r0": "0"}, 2.0)
    (runtime,) = config["neuron_runtimes"]
    assert runtime["tag_filter"] == r"^(inf2serve\.r0)$"
    assert {m["type"] for m in runtime["metrics"]} == {
        "neuroncore_counters",
        "memory_used",
        "execution_stats",
    }
    assert config["system_metrics"] == [] and config["period"] == "2s"


def fake_monitor(folder: Path, reports: list[dict[str, Any]], then: str) -> Path:
    """An executable that records its arguments, prints `reports` one per line, then sleeps or exits."""
    lines = folder / "reports.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in reports))
    script = folder / "neuron-monitor"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, time\n"
        f"open({str(folder / 'args.json')!r}, 'w').write(json.dumps([sys.argv[1:], os.getpid()]))\n"
        f"sys.stdout.write(open({str(lines)!r}).read()); sys.stdout.flush()\n"
        f"{'time.sleep(60)' if then == 'sleep' else 'sys.exit(0)'}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


async def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_monitor_child_is_limited_to_our_runtime_and_stopped(tmp_path: Path) -> None:
    script = fake_monitor(tmp_path, [report("effective_flops", utilization=88.0)], then="sleep")

    async def scenario() -> int:
        device = DeviceMetrics(str(script), period_s=1.0, tags={TAG: "0"})
        device.start()
        labels = {"core": "0", "source": "neuron-monitor", "replica": "0"}
        await wait_for(lambda: sample("neuroncore_utilization_ratio", **labels) == 0.88)
        await wait_for(lambda: (tmp_path / "args.json").exists())
        args, pid = json.loads((tmp_path / "args.json").read_text())
        config = json.loads(Path(args[1]).read_text())
        assert args[0] == "-c" and config["neuron_runtimes"][0]["tag_filter"] == f"^({re.escape(TAG)})$"
        await device.stop()
        return pid

    pid = asyncio.run(scenario())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_engine_busy_fraction_fills_the_gauge_without_a_monitor() -> None:
    async def scenario() -> None:
        device = DeviceMetrics(None, period_s=0.05, busy_fractions=lambda: {"0": 0.37})
        device.start()
        labels = {"core": "all", "source": "engine", "replica": "0"}
        await wait_for(lambda: sample("neuroncore_utilization_ratio", **labels) == 0.37)
        await device.stop()

    asyncio.run(scenario())


def test_engine_takes_over_when_the_monitor_exits(tmp_path: Path) -> None:
    script = fake_monitor(tmp_path, [copy.deepcopy(report())], then="exit")

    async def scenario() -> None:
        device = DeviceMetrics(
            str(script), period_s=0.05, tags={TAG: "0"}, busy_fractions=lambda: {"0": 0.61}
        )
        device.start()
        labels = {"core": "all", "source": "engine", "replica": "0"}
        await wait_for(lambda: sample("neuroncore_utilization_ratio", **labels) == 0.61)
        await device.stop()

    asyncio.run(scenario())


def test_for_backend_uses_the_monitor_only_for_neuron_backends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_monitor(tmp_path, [], then="exit")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert DeviceMetrics.for_backend("neuron-nxdi").monitor_path == str(tmp_path / "neuron-monitor")
    assert DeviceMetrics.for_backend("torch").monitor_path is None


def test_without_a_monitor_the_gauge_reads_the_engines_last_busy_window() -> None:
    metrics.record_engine_busy(0.42)
    assert DeviceMetrics(None).busy_fractions()["0"] == 0.42
    assert sample("engine_busy_ratio", replica="0") == 0.42
