"""Server settings: every knob of `inf2serve serve`, from flags or the environment (prefix `INF2SERVE_`).

Read once at startup and passed down; nothing else in `app/` reads `os.environ` for its own settings
(`app/process_settings.py` holds the few that code outside the server also uses). Defaults follow the
SageMaker container contract (listen on 0.0.0.0:8080, or `SAGEMAKER_BIND_TO_PORT`; the artifact in
`/opt/ml/model`), so a bare `serve` needs no configuration.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.engine.config import EngineConfig
from app.errors import ConfigError

SAGEMAKER_MODEL_DIR = "/opt/ml/model"
SAGEMAKER_MAX_PAYLOAD_BYTES = 6_291_456  # InvokeEndpoint's request body limit
_ENGINE = {field.name: field.default for field in fields(EngineConfig)}
USABLE_KEY = re.compile(r"[\x21-\x7e]{1,4096}")  # visible ASCII, as a bearer token is sent


class ServerSettings(BaseSettings):
    """Flags win over `INF2SERVE_*` variables, which win over the defaults below."""

    model_config = SettingsConfigDict(env_prefix="INF2SERVE_", populate_by_name=True, extra="forbid")

    # What to serve, and on what.
    artifact: str = Field(SAGEMAKER_MODEL_DIR, description="Artifact URI: a local directory or s3://...")
    cache_dir: Path | None = Field(None, description="Where S3 artifacts are downloaded (loader default).")
    device: str = Field(
        "cpu",
        description="Device the backend runs on (cpu, cuda, neuron); neuron:<cores> pins NeuronCores "
        "(any NEURON_RT_VISIBLE_CORES form, tp_degree contiguous cores per replica).",
    )
    served_model_name: str | None = Field(None, description="Model name for the API (manifest's if unset).")
    verify_golden: bool = Field(True, description="Replay the artifact's golden prompts before ready.")
    allow_random_weights: bool = Field(
        False, description="Serve an artifact with random weights (demos, tests); refused otherwise."
    )
    allow_failed_validation: bool = Field(
        False, description="Serve an artifact whose validation did not pass; refused otherwise."
    )
    replicas: str = Field(
        "1",
        pattern=r"^(auto|[1-9][0-9]*)$",
        description="Engine processes, each on its own device placement (a contiguous NeuronCore group "
        "of tp_degree cores on neuron); auto: as many groups as the visible cores hold (1 off neuron).",
    )
    replica_routing: Literal["least_work", "round_robin"] = Field(
        "least_work", description="How the front picks a replica (round_robin: the benchmark baseline)."
    )
    api_servers: int = Field(
        1,
        ge=1,
        le=64,
        description="Front (HTTP) processes sharing the port, as vLLM's --api-server-count: each serves the "
        "whole API over its share of the replicas (front i: replicas i, i+N, ...), so the front's CPU is not "
        "capped by one process's GIL; needs at least as many replicas.",
    )
    visible_cores: str | None = Field(
        None,
        validation_alias=AliasChoices("INF2SERVE_VISIBLE_CORES", "NEURON_RT_VISIBLE_CORES"),
        description="NeuronCores this container may use (NEURON_RT_VISIBLE_CORES, e.g. as the Kubernetes "
        "device plugin sets it); unset: every core of the instance's Neuron devices.",
    )

    # Where to listen and how to stop.
    host: str = "0.0.0.0"
    port: int = Field(
        8080, ge=1, le=65535, validation_alias=AliasChoices("INF2SERVE_PORT", "SAGEMAKER_BIND_TO_PORT")
    )
    keep_alive_s: float = Field(
        75.0, gt=0, description="Idle keep-alive; above ALB's default 60 s idle timeout."
    )
    drain_s: float = Field(
        10.0, ge=0, description="After SIGTERM: seconds of not-ready while still serving new requests."
    )
    shutdown_timeout_s: float = Field(
        15.0, gt=0, description="After the drain window: how long in-flight requests may take to finish."
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Slow or greedy clients (app/api/connections.py).
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time to send a request's headers, from connecting (or its first byte); 408."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Time to send a request's whole body once its headers are in; 408."
    )
    max_header_bytes: int = Field(
        65536, ge=1024, description="Size of a request's headers, request line included; beyond it, 431."
    )
    max_connections: int = Field(
        1024, ge=1, description="Open connections (and requests in progress); beyond it, 503 at once."
    )
    refusal_budget_per_s: float = Field(
        100.0,
        ge=0,
        description="Refusals (4xx but 429) a second, each counted 1 plus 1 per 64 KiB of body it sent; "
        "beyond it (a second's worth is kept), refusals are answered one at a time as the budget refills, "
        "so a client looping bad requests is paced; nothing else waits; 0: no budget (app/api/refusals.py).",
    )

    # Access control.
    api_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Accepted bearer tokens, comma-separated. Unset: no authentication; set, it must "
        "yield at least one key.",
    )
    api_keys_file: Path | None = Field(
        None, description="A file with one accepted bearer token per line (at least one)."
    )

    # Request limits (a request over one gets 400 naming it, 413 for the body).
    max_body_bytes: int = Field(SAGEMAKER_MAX_PAYLOAD_BYTES, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1, description="Default: the largest context bucket.")
    max_output_tokens: int | None = Field(None, ge=1, description="Cap on max_tokens; default max positions.")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens of a completion that sets none.")
    max_n: int = Field(8, ge=1)
    max_stop_strings: int = Field(4, ge=0)
    max_stop_string_chars: int = Field(256, ge=1)
    max_logprobs: int = Field(20, ge=0, description="Largest logprobs / top_logprobs a request may ask.")

    # Chat templates and tool calls.
    chat_template: Path | None = Field(
        None,
        description="A Jinja chat template file used instead of the artifact's (vLLM's --chat-template).",
    )
    tool_call_parser: Literal["llama3_json", "pythonic"] | None = Field(
        None,
        description="How tool calls are read from the output (vLLM's names); default: both Llama 3 forms.",
    )

    # Engine (defaults are EngineConfig's).
    max_waiting: int = Field(_ENGINE["max_waiting"], ge=1, description="Queue bound; beyond it, 429.")
    max_prefills_per_step: int = Field(_ENGINE["max_prefills_per_step"], ge=1)
    max_queue_wait_s: float | None = Field(
        _ENGINE["max_queue_wait_s"], gt=0, description="A request waiting longer for a slot fails."
    )
    request_timeout_s: float | None = Field(
        _ENGINE["request_timeout_s"], gt=0, description="Deadline of one request, queue included."
    )
    stream_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of one streamed request, queue included; unset: request_timeout_s. Lets "
        "streams outlive a deadline a platform forces on responses sent at once (SageMaker's 60 s).",
    )
    run_ahead: bool = Field(
        _ENGINE["run_ahead"],
        description="Launch each step before the previous one's tokens are back, where the backend allows.",
    )
    policy: Literal["slo", "fifo", "tgi-neuron", "vllm-neuron", "optimum-neuron"] = Field(
        _ENGINE["policy"],
        description="Scheduling policy: slo (meets the SLOs below), fifo, or a peer's (for benchmarks).",
    )
    slo_ttft_ms: float = Field(
        _ENGINE["slo_ttft_ms"], gt=0, description="Time-to-first-token target (p99) the slo policy keeps."
    )
    slo_tpot_ms: float = Field(
        _ENGINE["slo_tpot_ms"], gt=0, description="Time per output token each request should stay within."
    )

    enable_prefix_caching: bool | None = Field(
        _ENGINE["enable_prefix_caching"],
        description="Automatic prefix caching: cached prompt prefixes are not prefilled again. Unset: on "
        "where the artifact's backend keeps KV in blocks; set on a backend without, startup fails.",
    )
    prefix_cache_salt_by_api_key: bool = Field(
        True,
        description="With API keys set, requests share cached prefixes only with requests under the same "
        "key, so one tenant cannot learn another's prompts from response times.",
    )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            **{name: getattr(self, name) for name in _ENGINE if name in type(self).model_fields}
        )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @model_validator(mode="after")
    def _check_api_servers(self) -> ServerSettings:
        """Each front process owns at least one replica (`auto` is checked once the placements are known)."""
        if self.api_servers > 1 and self.replicas != "auto" and int(self.replicas) < self.api_servers:
            raise ValueError(
                f"api_servers ({self.api_servers}) needs at least as many replicas "
                f"(replicas={self.replicas}): each front process serves its own share of them"
            )
        return self

    @model_validator(mode="after")
    def _check_shutdown(self) -> ServerSettings:
        """Requests accepted until the end of the drain window get `shutdown_timeout_s` to finish."""
        if self.shutdown_timeout_s < self.drain_s:
            raise ValueError(
                f"shutdown_timeout_s ({self.shutdown_timeout_s}) must be at least drain_s ({self.drain_s}): "
                "requests accepted during the drain window would otherwise get less time to finish than "
                "the window itself lasts"
            )
        return self

    @model_validator(mode="after")
    def _read_keys_file(self) -> ServerSettings:
        """Authentication fails closed: a key setting that yields no usable key is an error, never "no
        authentication". Raised as ConfigError, not ValueError: pydantic's message would echo the keys."""
        if self.api_keys_file is not None:
            try:
                lines = self.api_keys_file.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ConfigError(f"api_keys_file {self.api_keys_file} cannot be read: {error}") from None
            self.api_keys = (*self.api_keys, *(line.strip() for line in lines if line.strip()))
        configured = "api_keys" in self.model_fields_set or self.api_keys_file is not None
        if configured and not self.api_keys:
            raise ConfigError(
                "API keys are configured (INF2SERVE_API_KEYS or api_keys_file) but none is usable: every "
                "entry is empty; give at least one key, or unset both to serve without authentication"
            )
        if not all(USABLE_KEY.fullmatch(key) for key in self.api_keys):
            raise ConfigError("an API key must be 1-4096 visible ASCII characters, without spaces")
        return self
