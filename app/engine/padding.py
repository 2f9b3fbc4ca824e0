"""What a padded batch computes usefully and what it wastes: one definition for the padding metrics and the
scheduler benchmark.

Prefill: rows are the prompts (never padded), tokens are prompt tokens against `rows x context_bucket`.
Decode: rows are live sequences against `batch_bucket`, tokens are attended KV positions (each row's
position + 1) against `batch_bucket x token_bucket`.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.backends.base import DecodeBatch, PrefillBatch


@dataclass(frozen=True, slots=True)
class BatchUsage:
    phase: str  # "prefill" or "decode"
    bucket: str  # the compiled shape, as a metric label
    rows: int
    padded_rows: int
    tokens: int
    padded_tokens: int


def batch_usage(batch: PrefillBatch | DecodeBatch) -> BatchUsage:
    if isinstance(batch, PrefillBatch):
        rows = len(batch.prompts)
        tokens = sum(len(batch.uncached(row)) for row in range(rows))  # a cached prefix is not computed
        return BatchUsage(
            "prefill", str(batch.context_bucket), rows, 0, tokens, rows * batch.context_bucket - tokens
        )
    tokens = sum(batch.positions) + len(batch.positions)
    shape = batch.batch_bucket * batch.token_bucket
    return BatchUsage(
        "decode",
        f"{batch.batch_bucket}x{batch.token_bucket}",
        len(batch.slots),
        batch.batch_bucket - len(batch.slots),
        tokens,
        shape - tokens,
    )
