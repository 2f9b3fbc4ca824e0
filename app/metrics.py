"""Every Prometheus metric the server exports, in one module.

Names follow vLLM's (`vllm:time_to_first_token_seconds` is ours `inf2serve_time_to_first_token_seconds`)
so existing dashboards port by swapping the prefix; padding metrics follow vllm-neuron's. The prefix ends
in `_`, not vLLM's `:`, because Prometheus reserves colons for recording rules and `promtool check
metrics` rejects them. Code records through the `record_*` helpers here, never through prometheus_client
directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
PREFIX = "inf2serve_"

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


# Request level.
TTFT = Histogram(
    _name("time_to_first_token_seconds"),
    "Time from arrival to the first token.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN = Histogram(
    _name("inter_token_latency_seconds"),
    "Time between consecutive output tokens.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E = Histogram(
    _name("e2e_request_latency_seconds"),
    "Time from arrival to the last token.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_TIME = Histogram(
    _name("request_queue_time_seconds"),
    "Time spent waiting for a slot.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(_name("prompt_tokens"), "Prompt tokens processed.", registry=REGISTRY)
GENERATION_TOKENS = Counter(_name("generation_tokens"), "Tokens generated.", registry=REGISTRY)
REQUEST_PROMPT_TOKENS = Histogram(
    _name("request_prompt_tokens"), "Prompt length per request.", buckets=_TOKEN_BUCKETS, registry=REGISTRY
)
REQUEST_GENERATION_TOKENS = Histogram(
    _name("request_generation_tokens"),
    "Generated tokens per request.",
    buckets=_TOKEN_BUCKETS,
    registry=REGISTRY,
)
REQUEST_SUCCESS = Counter(
    _name("request_success"), "Finished requests by finish reason.", ["finished_reason"], registry=REGISTRY
)
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

# Engine level.
RUNNING = Gauge(_name("num_requests_running"), "Requests holding a slot.", registry=REGISTRY)
WAITING = Gauge(_name("num_requests_waiting"), "Requests waiting for a slot.", registry=REGISTRY)
SLOT_USAGE = Gauge(_name("slot_usage_perc"), "Fraction of compiled slots in use (0..1).", registry=REGISTRY)
STEP_TIME = Histogram(
    _name("step_duration_seconds"),
    "Device step time by phase and bucket.",
    ["phase", "bucket"],
    buckets=_STEP_BUCKETS,
    registry=REGISTRY,
)
PADDED_ROWS = Counter(
    _name("num_seqs_padding"),
    "Padded (wasted) batch rows, by phase and bucket.",
    ["phase", "bucket"],
    registry=REGISTRY,
)
PADDED_TOKENS = Counter(
    _name("num_batched_tokens_padding"),
    "Padded (wasted) tokens, by phase and bucket.",
    ["phase", "bucket"],
    registry=REGISTRY,
)
BATCHED_TOKENS = Counter(
    _name("num_batched_tokens"),
    "Useful tokens computed, by phase and bucket.",
    ["phase", "bucket"],
    registry=REGISTRY,
)
DECODE_STALL = Histogram(
    _name("decode_stall_seconds"),
    "Time running decodes waited on prefills in a step.",
    buckets=_STEP_BUCKETS,
    registry=REGISTRY,
)
ENGINE_BUSY = Gauge(
    _name("engine_busy_ratio"), "Fraction of recent wall time the device was executing.", registry=REGISTRY
)
_engine_busy = 0.0  # ENGINE_BUSY's value, kept for the device metrics without reading the registry back

# Device level (neuron-monitor on inf2, the engine's own busy fraction elsewhere: see `source`).
CORE_UTILIZATION = Gauge(
    _name("neuroncore_utilization_ratio"),
    "NeuronCore utilization (0..1).",
    ["core", "source"],
    registry=REGISTRY,
)
DEVICE_MEMORY = Gauge(
    _name("device_memory_used_bytes"), "Device memory used.", ["core", "category"], registry=REGISTRY
)
EXECUTION_ERRORS = Counter(
    _name("neuron_execution_errors"),
    "NeuronCore execution errors by type.",
    ["error_type"],
    registry=REGISTRY,
)
EXECUTION_LATENCY = Gauge(
    _name("neuron_execution_latency_seconds"),
    "Runtime execution latency percentile.",
    ["percentile"],
    registry=REGISTRY,
)
CORE_FLOPS = Gauge(
    _name("neuroncore_flops"),
    "Floating-point operations neuron-monitor counted on the core in its last period.",
    ["core"],
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


def render() -> bytes:
    """The text exposition of every metric, for `/metrics`."""
    return generate_latest(REGISTRY)


# Helpers for the HTTP layer and startup (app/api/).
def record_http_response(route: str, status: int) -> None:
    HTTP_RESPONSES.labels(route, str(status)).inc()


def record_request_failure(error_type: str) -> None:
    REQUEST_FAILURE.labels(error_type).inc()


def record_startup_phase(phase: str, seconds: float) -> None:
    STARTUP_PHASE.labels(phase).set(seconds)


def record_artifact(artifact_id: str, model_name: str, backend: str, bytes_loaded: int) -> None:
    ARTIFACT.info({"artifact_id": artifact_id, "model_name": model_name, "backend": backend})
    BYTES_LOADED.set(bytes_loaded)


def record_ready(ready: bool) -> None:
    READY.set(1 if ready else 0)


# Helpers for the engine (app/engine/): the output thread calls these, never the step loop.
def record_step_call(
    phase: str, bucket: str, seconds: float, padded_rows: int, tokens: int, padded_tokens: int
) -> None:
    """One backend call: its time, and useful vs padded work (see app/engine/padding.py)."""
    STEP_TIME.labels(phase, bucket).observe(seconds)
    PADDED_ROWS.labels(phase, bucket).inc(padded_rows)
    BATCHED_TOKENS.labels(phase, bucket).inc(tokens)
    PADDED_TOKENS.labels(phase, bucket).inc(padded_tokens)


def record_decode_stall(seconds: float) -> None:
    DECODE_STALL.observe(seconds)


def record_engine_state(num_running: int, num_waiting: int, num_slots: int) -> None:
    RUNNING.set(num_running)
    WAITING.set(num_waiting)
    SLOT_USAGE.set(num_running / num_slots)


def record_engine_busy(ratio: float) -> None:
    global _engine_busy
    _engine_busy = ratio
    ENGINE_BUSY.set(ratio)


def record_first_token(queue_s: float, time_to_first_token_s: float) -> None:
    QUEUE_TIME.observe(queue_s)
    TTFT.observe(time_to_first_token_s)


def record_prompt_tokens(num_tokens: int) -> None:
    PROMPT_TOKENS.inc(num_tokens)


def record_inter_token(seconds: float) -> None:
    INTER_TOKEN.observe(seconds)


def record_generated_tokens(num_tokens: int) -> None:
    GENERATION_TOKENS.inc(num_tokens)


def record_request_finished(
    reason: str, failed: bool, num_prompt_tokens: int, num_generated_tokens: int, e2e_s: float
) -> None:
    """An engine request's end: success by finish reason (stop, length, abort). A failed one is left to
    the HTTP layer, which counts every failure (validation and admission too) once per HTTP request."""
    if not failed:
        REQUEST_SUCCESS.labels(reason).inc()
    E2E.observe(e2e_s)
    REQUEST_PROMPT_TOKENS.observe(num_prompt_tokens)
    REQUEST_GENERATION_TOKENS.observe(num_generated_tokens)


# Helpers for the device metrics (app/device_metrics.py).
def record_core_utilization(core: str, ratio: float, source: str) -> None:
    CORE_UTILIZATION.labels(core, source).set(ratio)


def record_core_flops(core: str, flops: float) -> None:
    CORE_FLOPS.labels(core).set(flops)


def record_device_memory(core: str, category: str, size: float) -> None:
    DEVICE_MEMORY.labels(core, category).set(size)


def record_execution_errors(error_type: str, count: float) -> None:
    EXECUTION_ERRORS.labels(error_type).inc(count)


def record_execution_latency(percentile: str, seconds: float) -> None:
    EXECUTION_LATENCY.labels(percentile).set(seconds)


def engine_busy_ratio() -> float:
    """The engine's busy fraction as it last recorded it (0 before its first window closes)."""
    return _engine_busy
