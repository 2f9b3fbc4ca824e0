"""Process-wide tuning that code below the server reads too (the artifact loader and its S3 reads, the
simulated device), from the same `INF2SERVE_*` variables: kept apart from `app/settings.py`, which sits
above the engine, so that those lower layers need nothing above them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.errors import ConfigError

DEFAULT_CACHE_DIR = Path("~/.cache/inf2serve/artifacts")


class ProcessSettings(BaseSettings):
    """Process-wide tuning read from the same `INF2SERVE_*` variables by whatever runs in the process
    (the server, `inf2serve artifacts pull`, the compile step, the benchmarks): the artifact cache, how
    S3 reads are cut up (`app.artifacts.storage.TransferConfig`), and the simulated device's cost model."""

    model_config = SettingsConfigDict(env_prefix="INF2SERVE_", extra="ignore")

    cache_dir: Path = Field(DEFAULT_CACHE_DIR, description="Where S3 artifacts are downloaded.")
    s3_part_mb: float = Field(8.0, gt=0, description="First timed part, and each ranged GET, in MiB.")
    s3_concurrency: int = Field(8, ge=1, description="Ranged GETs in flight per object (1: never split).")
    s3_ranges: Literal["auto", "always"] = Field(
        "auto", description="Split into ranged GETs where the first part shows it pays, or always."
    )
    sim_cost_model: dict[str, Any] | str | None = Field(
        None,
        description="The sim device's cost model: a preset name or its fields as JSON (over the artifact's).",
    )

    @field_validator("cache_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @classmethod
    def read(cls) -> ProcessSettings:
        """From the environment; a bad value is a ConfigError naming the variable."""
        try:
            return cls()
        except ValidationError as error:
            problem = error.errors()[0]
            name = cls.model_config["env_prefix"] + str(problem["loc"][0]).upper()
            raise ConfigError(f"{name} is {problem['input']!r}: {problem['msg']}") from None
