"""The engine's scheduling limits. The shape grid (slots, buckets, positions) comes from the artifact; these
come from the server's settings."""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_waiting: int = 256
    """Bound of the waiting queue; `generate` raises OverloadedError beyond it."""
    max_prefills_per_step: int = 4
    """New sequences admitted per step: bounds how long prefills stall the running decodes."""
    max_prefill_tokens_per_step: int | None = None
    """Padded prompt tokens admitted per step (None: unbounded). The queue head is always admitted."""
    max_queue_wait_s: float | None = 60.0
    """A request still waiting for a slot after this long fails (DeadlineExceededError)."""
    request_timeout_s: float | None = None
    """Deadline of a request that brings none (`GenerationParams.deadline`); None: no deadline."""
    static_batching: bool = False
    """Run-to-completion batches (admit only into an empty engine): the baseline for benchmarks."""
    policy: str = "slo"
    """How steps are scheduled (`app/engine/policies.py`): slo (ours), fifo, or a peer's policy for
    benchmarks (tgi-neuron, vllm-neuron, optimum-neuron)."""
    slo_ttft_ms: float = 2000.0
    """Time-to-first-token target the `slo` policy schedules for (p99)."""
    slo_tpot_ms: float = 100.0
    """Time-per-output-token target the `slo` policy schedules for (each request's mean after its first)."""
    enable_prefix_caching: bool | None = None
    """Cache full KV blocks of prompts and outputs by prefix and prefill only what is not cached
    (`app/engine/blocks.py`). None: on where the backend keeps its KV in blocks; True there only."""
    run_ahead: bool = True
    """Launch step n+1 before step n's tokens are back, where the backend feeds tokens back on the device
    (`Backend.feeds_back_tokens`), so the host's work overlaps the device's instead of idling it."""

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_prefills_per_step", "max_prefill_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        from app.engine.policies import POLICIES  # the policies read this config

        if self.policy not in POLICIES:
            raise ConfigError(
                f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}"
            )
        if self.static_batching and self.policy != "fifo":
            raise ConfigError(f"static_batching is a mode of the fifo policy, not of {self.policy!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_queue_wait_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive (or None for no limit), got {value}")
