"""Canary analysis on canned `/metrics` text and canned HTTP replies (no server): quantiles from bucket
deltas, the checks and their thresholds, the verdict table, prompt sources and the replay client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from app.artifacts.golden import Golden, GoldenPrompt
from app.cli import main
from app.errors import ConfigError
from deploy.canary.cli import load_prompts
from deploy.canary.metrics import Scrape, bucket_quantile
from deploy.canary.replay import Prompt, Reply, file_prompts, replay
from deploy.canary.verdict import Observation, Thresholds, evaluate, render
from tests.s3_server import free_port

BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0)


def exposition(latency_counts: dict[float, int], ok: int, errors: int, not_ready: int = 0) -> str:
    """A `/metrics` text with the three latency histograms (same counts) and the HTTP response counter."""
    lines = []
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        name = f"inf2serve_{histogram}_seconds"
        lines += [f"# HELP {name} h", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound in (*BOUNDS, float("inf")):
            cumulative += latency_counts.get(bound, 0)
            le = "+Inf" if bound == float("inf") else str(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{name}_count {cumulative}", f"{name}_sum 1.0"]
    lines += ["# HELP inf2serve_http_responses_total r", "# TYPE inf2serve_http_responses_total counter"]
    lines.append(f'inf2serve_http_responses_total{{route="/v1/completions",status="200"}} {ok}')
    lines.append(f'inf2serve_http_responses_total{{route="/v1/completions",status="500"}} {errors}')
    lines.append(f'inf2serve_http_responses_total{{route="/ready",status="503"}} {not_ready}')
    return "\n".join(lines) + "\n"


def observation(
    texts: list[str | None], latency_counts: dict[float, int], ok: int = 10, errors: int = 0
) -> Observation:
    before = Scrape.parse(exposition({0.01: 5}, ok=100, errors=1))
    after = Scrape.parse(
        exposition({0.01: 5, **{b: n for b, n in latency_counts.items() if b != 0.01}}, 100 + ok, 1 + errors)
    )
    replies = [Reply(t, None if t is not None else "HTTP 500: device lost") for t in texts]
    return Observation(replies, after - before)


FAST = {0.05: 8, 0.1: 2}
SLOW = {0.5: 8, 1.0: 2}


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_bucket_quantile_interpolates_like_promql() -> None:
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.5, 8.0), (float("inf"), 10.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.175)  # rank 5 in (0.1, 0.2]: 0.1 + 0.1 * 3/4
    assert bucket_quantile(0.1, buckets) == pytest.approx(0.05)  # rank 1 in the first bucket, from 0
    assert bucket_quantile(0.99, buckets) == 0.5  # in +Inf: the highest finite bound
    assert bucket_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_scrape_delta_keeps_only_what_happened_in_between() -> None:
    delta = Scrape.parse(exposition(FAST, ok=30, errors=2)) - Scrape.parse(exposition({}, ok=10, errors=1))
    assert delta.total("inf2serve_http_responses_total") == 21
    assert delta.total("inf2serve_http_responses_total", lambda labels: labels["status"] == "500") == 1
    assert delta.buckets("inf2serve_time_to_first_token_seconds")[-1] == (float("inf"), 10.0)
    assert delta.quantile("inf2serve_time_to_first_token_seconds", 0.5) == pytest.approx(0.01 + 0.04 * 5 / 8)


def test_healthy_canary_is_promoted() -> None:
    texts = ["once upon", "a time", "there was"]
    checks = evaluate(observation(texts, FAST), observation(texts, FAST), Thresholds())
    assert all(c.passed for c in checks), render(checks)
    assert {"greedy agreement", "replay error rate", "server 5xx rate", "TTFT p99", "e2e p50"} <= set(
        by_name(checks)
    )
    assert render(checks).endswith("verdict: PROMOTE")


def test_different_outputs_fail_agreement() -> None:
    baseline = observation(["once upon", "a time", "there was", "a cat"], FAST)
    candidate = observation(["once upon", "a dog", "there was", "a cat"], FAST)
    check = by_name(evaluate(baseline, candidate, Thresholds()))["greedy agreement"]
    assert (check.candidate, check.passed) == ("0.750", False)
    assert by_name(evaluate(baseline, candidate, Thresholds(min_agreement=0.75)))["greedy agreement"].passed


def test_candidate_errors_fail() -> None:
    baseline = observation(["a", "b"], FAST)
    candidate = observation(["a", None], FAST, ok=9, errors=1)
    checks = by_name(evaluate(baseline, candidate, Thresholds()))
    assert not checks["replay error rate"].passed
    assert not checks["server 5xx rate"].passed  # 10% against an allowed 0% + 1%
    assert checks["greedy agreement"].passed  # judged on the prompts both answered
    table = render(list(checks.values()))
    assert "replay error rate: candidate's first failed request: HTTP 500: device lost" in table
    assert table.endswith("verdict: ROLL BACK")


def test_readiness_503s_are_not_serving_errors() -> None:
    delta = Scrape.parse(exposition(FAST, 10, 0, not_ready=40)) - Scrape.parse(exposition({}, 0, 0))
    assert Observation([Reply("a")], delta).error_rate() == 0.0


def test_slower_candidate_fails_latency_within_ratio_passes() -> None:
    checks = by_name(evaluate(observation(["a"], FAST), observation(["a"], SLOW), Thresholds()))
    assert not checks["TTFT p99"].passed and not checks["inter-token p50"].passed
    lenient = by_name(
        evaluate(observation(["a"], FAST), observation(["a"], SLOW), Thresholds(max_latency_ratio=20))
    )
    assert lenient["TTFT p99"].passed


def test_no_data_is_no_promotion() -> None:
    checks = by_name(evaluate(observation(["a"], {}, ok=0), observation(["a"], {}, ok=0), Thresholds()))
    assert not checks["TTFT p50"].passed and checks["TTFT p50"].candidate == "no data"
    assert not checks["server 5xx rate"].passed


def test_prompt_sources(tmp_path: Path) -> None:
    golden = tmp_path / "golden.json"
    record = GoldenPrompt("Once", (1, 9038), (263, 931, 2), ((),) * 3)
    golden.write_text(Golden((record,)).dumps())
    extra = tmp_path / "prompts.txt"
    extra.write_text('The cat\n\n{"prompt": "The dog", "max_tokens": 4}\n')
    prompts = load_prompts(None, golden, extra)
    assert prompts == [Prompt([1, 9038], 3), Prompt("The cat", 16), Prompt("The dog", 4)]
    extra.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"prompts\.txt:1"):
        file_prompts(extra)
    with pytest.raises(ConfigError, match="no prompts"):
        load_prompts(None, None, None)


def test_replay_records_text_or_error() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["prompt"] == "boom":
            return httpx.Response(500, json={"error": {"message": "device"}})
        if body["prompt"] == "drop":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"choices": [{"text": f"<{body['prompt']}>"}]})

    async def run() -> list[Reply]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://canary") as client:
            prompts = [Prompt("ab", 3), Prompt("boom", 3), Prompt("drop", 3), Prompt([5, 6], 2)]
            return await replay(client, prompts, concurrency=2)

    replies = asyncio.run(run())
    assert [r.text for r in replies] == ["<ab>", None, None, "<[5, 6]>"]
    assert replies[1].error == 'HTTP 500: {"error":{"message":"device"}}'
    assert "ConnectError" in (replies[2].error or "") and replies[0].error is None
    assert all(b["temperature"] == 0.0 and "model" not in b for b in seen)


def test_unreachable_endpoint_cannot_be_judged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\n")
    port = free_port()  # nothing listens there
    argv = ["canary", "--baseline", f"http://127.0.0.1:{port}", "--candidate", f"http://127.0.0.1:{port}"]
    assert main([*argv, "--prompts", str(prompts), "--timeout", "5"]) == 2
    assert "cannot judge" in capsys.readouterr().err
