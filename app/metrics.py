"""Every Prometheus metric the server exports, in one module.

Names follow vLLM's (`vllm:time_to_first_token_seconds` is ours `inf2serve_time_to_first_token_seconds`)
so existing dashboards port by swapping the prefix; padding metrics follow vllm-neuron's. The prefix ends
in `_`, not vLLM's `:`, because Prometheus reserves colons for recording rules and `promtool check
metrics` rejects them. Code records through the `record_*` helpers here, never through prometheus_client
directly.
"""

from __future__ import annotations

import collections
import functools
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Metric, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from app.engine.stats import FinishedRequest, StepStats

REGISTRY = CollectorRegistry(auto_describe=True)
PREFIX = "inf2serve_"
SINGLE_REPLICA = "0"  # the replica label of a server without replica processes
M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _name(suffix: str) -> str:
    return PREFIX + suffix


# Request and engine level: recorded from the engines' `StepStats`, each series labelled with the replica
# (engine process) that reported it, "0" when one process serves alone. `sum without (replica)` gives
# the server's total.
_R = ("replica",)


def _histogram(suffix: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
    return Histogram(_name(suffix), doc, [*_R, *labels], buckets=buckets, registry=REGISTRY)


def _counter(suffix: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(_name(suffix), doc, [*_R, *labels], registry=REGISTRY)


def _gauge(suffix: str, doc: str) -> Gauge:
    return Gauge(_name(suffix), doc, _R, registry=REGISTRY)


TTFT = _histogram("time_to_first_token_seconds", "Time from arrival to the first token.", _LATENCY_BUCKETS)
INTER_TOKEN = _histogram(
    "inter_token_latency_seconds", "Time between consecutive output tokens.", _LATENCY_BUCKETS
)
E2E = _histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", _LATENCY_BUCKETS)
QUEUE_TIME = _histogram("request_queue_time_seconds", "Time spent waiting for a slot.", _LATENCY_BUCKETS)
PROMPT_TOKENS = _counter("prompt_tokens", "Prompt tokens processed.")
GENERATION_TOKENS = _counter("generation_tokens", "Tokens generated.")
REQUEST_PROMPT_TOKENS = _histogram("request_prompt_tokens", "Prompt length per request.", _TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = _histogram(
    "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
)
REQUEST_SUCCESS = _counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
RUNNING = _gauge("num_requests_running", "Requests holding a slot.")
WAITING = _gauge("num_requests_waiting", "Requests waiting for a slot.")
SLOT_USAGE = _gauge("slot_usage_perc", "Fraction of compiled slots in use (0..1).")
_PHASE_BUCKET = ("phase", "bucket")
STEP_TIME = _histogram(
    "step_duration_seconds", "Device step time by phase and bucket.", _STEP_BUCKETS, _PHASE_BUCKET
)
PADDED_ROWS = _counter("num_seqs_padding", "Padded (wasted) batch rows, by phase and bucket.", _PHASE_BUCKET)
PADDED_TOKENS = _counter(
    "num_batched_tokens_padding", "Padded (wasted) tokens, by phase and bucket.", _PHASE_BUCKET
)
BATCHED_TOKENS = _counter("num_batched_tokens", "Useful tokens computed, by phase and bucket.", _PHASE_BUCKET)
PREEMPTIONS = _counter(
    "num_preemptions", "Requests evicted from their slots to be prefilled again later (the slo policy)."
)
PREFIX_CACHE_QUERIES = _counter(
    "prefix_cache_queries",
    "Prompt tokens looked up in the prefix cache at their first prefill (vLLM's name).",
)
PREFIX_CACHE_HITS = _counter(
    "prefix_cache_hits", "Of the prompt tokens looked up, those found cached (vLLM's name): hits / queries."
)
KV_CACHE_USAGE = _gauge(
    "kv_cache_usage_perc", "Fraction of KV blocks held by requests (0..1), with prefix caching."
)
DECODE_STALL = _histogram(
    "decode_stall_seconds",
    "Time running decodes waited on prefills in a step (a prefill-only step counts as one).",
    _STEP_BUCKETS,
)
REQUEST_DECODE_STALL = _histogram(
    "request_decode_stall_seconds",
    "Per request: time between its first and last token not spent in its decode steps (others' prefills).",
    _LATENCY_BUCKETS,
)
REQUEST_SLO = _counter(
    "request_slo",
    "Finished requests by SLO result (met, ttft_missed, tpot_missed, both_missed) against the configured "
    "--slo-ttft-ms / --slo-tpot-ms; attainment = met / all.",
    ("result",),
)
ENGINE_BUSY = _gauge("engine_busy_ratio", "Fraction of recent wall time the device was executing.")
_engine_busy: dict[str, float] = {}  # ENGINE_BUSY per replica, for the device metrics without a registry read
_engine_state: dict[str, tuple[int, int, int]] = {}  # replica -> (running, waiting, slots), last step


class _ServerTotals(Collector):
    """The whole server's queue and slot use, summed over its replicas at scrape time: one series per
    server (no replica label), as a load balancer that scrapes each server reads it. These are the
    Gateway API Inference Extension's model-server protocol metrics (TotalQueuedRequests,
    TotalRunningRequests, KVCacheUtilization; deploy/eks/inference/ maps them for its endpoint picker):
    a compiled slot holds its sequence's whole KV cache, so slot use is KV-cache use."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states = list(_engine_state.values())
        running, waiting = sum(s[0] for s in states), sum(s[1] for s in states)
        slots = sum(s[2] for s in states)
        yield from _server_totals(waiting, running, slots)


def _server_totals(waiting: float, running: float, slots: float) -> Iterator[GaugeMetricFamily]:
    yield GaugeMetricFamily(
        _name("server_requests_waiting"), "Requests waiting for a slot, all replicas.", value=waiting
    )
    yield GaugeMetricFamily(
        _name("server_requests_running"), "Requests holding a slot, all replicas.", value=running
    )
    yield GaugeMetricFamily(_name("server_slots"), "Compiled slots (sequences), all replicas.", value=slots)
    yield GaugeMetricFamily(
        _name("server_slot_usage_perc"),
        "Fraction of the compiled slots (KV cache) in use over all replicas (0..1).",
        value=running / slots if slots else 0.0,
    )


REGISTRY.register(_ServerTotals())

# HTTP level (the front process).
REQUEST_FAILURE = Counter(
    _name("request_failure"),
    "Requests that ended in an error, by error type.",
    ["error_type"],
    registry=REGISTRY,
)
HTTP_RESPONSES = Counter(
    _name("http_responses"),
    "HTTP responses by route and status code.",
    ["route", "status"],
    registry=REGISTRY,
)
CLIENT_DISCONNECTS = Counter(
    _name("client_disconnects"),
    "Requests whose client disconnected before their response started (answered 499, as nginx logs it).",
    ["route"],
    registry=REGISTRY,
)

# Device level (neuron-monitor on inf2, the engine's own busy fraction elsewhere: see `source`).
# Each under the `replica` label of the engine whose runtime reported it ("0" without replicas).
CORE_UTILIZATION = Gauge(
    _name("neuroncore_utilization_ratio"),
    "NeuronCore utilization (0..1).",
    ["core", "source", "replica"],
    registry=REGISTRY,
)
DEVICE_MEMORY = Gauge(
    _name("device_memory_used_bytes"),
    "Device memory used.",
    ["core", "category", "replica"],
    registry=REGISTRY,
)
EXECUTION_ERRORS = Counter(
    _name("neuron_execution_errors"),
    "NeuronCore execution errors by type.",
    ["error_type", "replica"],
    registry=REGISTRY,
)
EXECUTION_LATENCY = Gauge(
    _name("neuron_execution_latency_seconds"),
    "Runtime execution latency percentile.",
    ["percentile", "replica"],
    registry=REGISTRY,
)
CORE_FLOPS = Gauge(
    _name("neuroncore_flops"),
    "Floating-point operations per second on the core over neuron-monitor's last period (its `flops`).",
    ["core", "replica"],
    registry=REGISTRY,
)

# Startup.
STARTUP_PHASE = Gauge(
    _name("startup_phase_seconds"), "Duration of each startup phase.", ["phase"], registry=REGISTRY
)
BYTES_LOADED = Gauge(
    _name("model_load_size_bytes"), "Bytes of artifact loaded at startup.", registry=REGISTRY
)
READY = Gauge(
    _name("ready"), "1 when the server is ready to serve, 0 while starting or draining.", registry=REGISTRY
)
ARTIFACT = Info(_name("artifact"), "The artifact this server serves.", registry=REGISTRY)
ARTIFACT_MEMORY = Gauge(
    _name("artifact_memory_bytes"),
    "The artifact's memory plan, bytes a tensor-parallel rank: weights, kv_cache, allowance, total, "
    "capacity.",
    ["component"],
    registry=REGISTRY,
)


def render() -> bytes:
    """The text exposition of every metric, for `/metrics`."""
    return generate_latest(REGISTRY)


def families() -> list[Metric]:
    """Every metric family with its current samples (what `render` writes), for another front process
    (`--api-servers`) to merge."""
    return list(REGISTRY.collect())


API_SERVER = "api_server"
_TOTALS = tuple(family.name for family in _server_totals(0, 0, 0))


def render_merged(by_front: Mapping[int, Sequence[Metric]]) -> bytes:
    """The text exposition of several front processes' families, by front index: every sample labelled
    with its front's `api_server`, except the server totals, which stay one series per server (summed)."""
    merged: dict[str, Metric] = {}
    totals = collections.Counter[str]()
    for front, front_families in sorted(by_front.items()):
        label = str(front)
        for family in front_families:
            if family.name in _TOTALS:
                totals[family.name] += sum(sample.value for sample in family.samples)
                continue
            into = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            into.samples += [s._replace(labels={**s.labels, API_SERVER: label}) for s in family.samples]
    waiting, running, slots = (
        totals[_name(n)] for n in ("server_requests_waiting", "server_requests_running", "server_slots")
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), *_server_totals(waiting, running, slots)]))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


# Helpers for the HTTP layer and startup (app/api/).
def record_http_response(route: str, status: int) -> None:
    HTTP_RESPONSES.labels(route, str(status)).inc()


def record_client_disconnect(route: str) -> None:
    CLIENT_DISCONNECTS.labels(route).inc()


def record_request_failure(error_type: str) -> None:
    REQUEST_FAILURE.labels(error_type).inc()


def record_startup_phase(phase: str, seconds: float) -> None:
    STARTUP_PHASE.labels(phase).set(seconds)


def record_artifact(
    artifact_id: str,
    model_name: str,
    backend: str,
    bytes_loaded: int,
    caveats: tuple[str, ...] = (),
    quantization: str | None = None,
) -> None:
    """`caveats`: what an operator allowed to serve anyway (`random_weights`, `validation_failed`);
    `quantization`: the weights' scheme (`int8-per_channel`), None for full precision."""
    labels = {"artifact_id": artifact_id, "model_name": model_name, "backend": backend}
    ARTIFACT.info({**labels, "caveats": ",".join(caveats) or "none", "quantization": quantization or "none"})
    BYTES_LOADED.set(bytes_loaded)


def record_artifact_memory(components: Mapping[str, int]) -> None:
    """The artifact's memory plan (`MemoryPlan.components`), bytes a rank."""
    for component, size in components.items():
        ARTIFACT_MEMORY.labels(component).set(size)


def record_ready(ready: bool) -> None:
    READY.set(1 if ready else 0)


@functools.cache
def _series(metric: M, *labels: str) -> M:
    """`metric.labels(*labels)`, kept: `labels` takes a lock and converts every value, and the front
    records every replica's every step (no series is ever removed, so a kept one stays the registry's)."""
    return metric.labels(*labels)


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe` of each value, with one increment per bucket touched: the inter-token latency
    has a value per token, and `observe` takes two locks each. Reads prometheus_client's Histogram
    (`_upper_bounds`, `_buckets`, `_sum`: a value counts in the first bucket whose bound is not below
    it); tests/test_metrics.py checks it against `observe`."""
    if not values:
        return
    buckets = collections.Counter(bisect_left(histogram._upper_bounds, value) for value in values)
    for bucket, count in buckets.items():
        histogram._buckets[bucket].inc(count)
    histogram._sum.inc(sum(values))


# The engine's step statistics (app/engine/stats.py): one record per step, from the output thread of
# this process or, with replicas, from each replica process through the front (app/replicas/).
def record_step_stats(stats: StepStats, replica: str = SINGLE_REPLICA) -> None:
    """Apply one step's record; every engine-side metric carries the replica that reported it."""
    for call in stats.calls:
        labels = (replica, call.phase, call.bucket)
        _series(STEP_TIME, *labels).observe(call.seconds)
        _series(PADDED_ROWS, *labels).inc(call.padded_rows)
        _series(BATCHED_TOKENS, *labels).inc(call.tokens)
        _series(PADDED_TOKENS, *labels).inc(call.padded_tokens)
    if stats.decode_stall_s:
        _series(DECODE_STALL, replica).observe(stats.decode_stall_s)
    if stats.preempted:
        _series(PREEMPTIONS, replica).inc(stats.preempted)
    _engine_state[replica] = (stats.num_running, stats.num_waiting, stats.num_slots)
    _series(RUNNING, replica).set(stats.num_running)
    _series(WAITING, replica).set(stats.num_waiting)
    _series(SLOT_USAGE, replica).set(stats.num_running / stats.num_slots)
    if stats.kv_cache_usage is not None:
        _series(KV_CACHE_USAGE, replica).set(stats.kv_cache_usage)
    if stats.busy_ratio is not None:
        record_engine_busy(stats.busy_ratio, replica)
    _series(GENERATION_TOKENS, replica).inc(stats.generated_tokens)
    for first in stats.first_tokens:
        _series(QUEUE_TIME, replica).observe(first.queue_s)
        _series(TTFT, replica).observe(first.time_to_first_token_s)
        _series(PROMPT_TOKENS, replica).inc(first.num_prompt_tokens)
        if first.num_cached_tokens is not None:
            _series(PREFIX_CACHE_QUERIES, replica).inc(first.num_prompt_tokens)
            _series(PREFIX_CACHE_HITS, replica).inc(first.num_cached_tokens)
    observe_all(_series(INTER_TOKEN, replica), stats.inter_token_s)
    for done in stats.finished:
        _record_finished(done, replica)


def _record_finished(done: FinishedRequest, replica: str) -> None:
    """An engine request's end: success by finish reason (stop, length, abort). A failed one is left to
    the HTTP layer, which counts every failure (validation and admission too) once per HTTP request."""
    if not done.failed:
        _series(REQUEST_SUCCESS, replica, done.reason).inc()
    if done.slo is not None:
        _series(REQUEST_SLO, replica, done.slo).inc()
        _series(REQUEST_DECODE_STALL, replica).observe(done.decode_stall_s)
    _series(E2E, replica).observe(done.e2e_s)
    _series(REQUEST_PROMPT_TOKENS, replica).observe(done.num_prompt_tokens)
    _series(REQUEST_GENERATION_TOKENS, replica).observe(done.num_generated_tokens)


def record_engine_busy(ratio: float, replica: str = SINGLE_REPLICA) -> None:
    _engine_busy[replica] = ratio
    _series(ENGINE_BUSY, replica).set(ratio)


def forget_replica(replica: str) -> None:
    """A replica process is gone (restarting): its gauges no longer describe anything."""
    for gauge in (RUNNING, WAITING, SLOT_USAGE, ENGINE_BUSY, KV_CACHE_USAGE):
        gauge.labels(replica).set(0)
    _engine_busy.pop(replica, None)
    _engine_state.pop(replica, None)


# Helpers for the device metrics (app/device_metrics.py).
def record_core_utilization(core: str, ratio: float, source: str, replica: str) -> None:
    CORE_UTILIZATION.labels(core, source, replica).set(ratio)


def record_core_flops(core: str, flops: float, replica: str) -> None:
    CORE_FLOPS.labels(core, replica).set(flops)


def record_device_memory(core: str, category: str, size: float, replica: str) -> None:
    DEVICE_MEMORY.labels(core, category, replica).set(size)


def record_execution_errors(error_type: str, count: float, replica: str) -> None:
    EXECUTION_ERRORS.labels(error_type, replica).inc(count)


def record_execution_latency(percentile: str, seconds: float, replica: str) -> None:
    EXECUTION_LATENCY.labels(percentile, replica).set(seconds)


def engine_busy_ratios() -> dict[str, float]:
    """Each engine's busy fraction as it last recorded it, by replica label (none before a first window
    closes)."""
    return dict(_engine_busy)
