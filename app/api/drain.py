"""What a draining server still takes: only requests expected to finish before it stops.

After SIGTERM the server serves on for the drain window, then gives in-flight work the shutdown timeout
(`app/api/server.py`); what is unfinished then is cut. So during the drain a request whose expected time
(its queue wait plus one measured step per token, `EngineClient.expected_time_s`; with replicas, the
pool's) runs past that stop is refused at once with 503 + Retry-After, before its first byte, for the
client to retry elsewhere, rather than accepted and cut mid-stream. An engine that measures nothing (or
has not yet) admits as usual.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from app.api.validation import EngineRequest
from app.engine.types import EngineClient
from app.errors import NotReadyError


def check_finishes_in_time(
    engine: EngineClient, requests: Sequence[EngineRequest], stop_at: float | None
) -> None:
    """Raise NotReadyError if the server stops (at `stop_at`, monotonic) before `requests` would end."""
    if stop_at is None or not requests:
        return
    expected = engine.expected_time_s(max(request.params.max_tokens for request in requests))
    left = stop_at - time.monotonic()
    if expected is not None and expected > left:
        raise NotReadyError(
            f"the server is shutting down in {max(left, 0.0):.1f} s and this request is expected to take "
            f"{expected:.1f} s: retry it (on another server)"
        )
