"""The canary's verdict on canned samples (agreement with each side's own golden, error rate, the
Mann-Whitney latency test with its effect floor and minimum sample size), its prompt sources, and its
targets: streamed /invocations parsed into token ids and timings, an API key and the ALB track header
sent, SageMaker's event stream read across PayloadPart boundaries."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest

from app.artifacts.golden import Golden, GoldenPrompt
from app.cli import main
from app.errors import ConfigError
from deploy.canary.replay import GoldenSet, file_prompts, workload
from deploy.canary.targets import TRACK_HEADER, HttpTarget, Prompt, SageMakerTarget, Sample, open_target
from deploy.canary.verdict import Thresholds, agreement, agreement_check, decide, error_check, latency_checks
from loadtest.harness.server import free_port

LIMITS = Thresholds()


def samples(scale: float, n: int = 64, seed: int = 0) -> list[Sample]:
    """Lognormal-ish latencies around 20 ms TTFT, 10 ms per token, 16 tokens, times `scale`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        noise = rng.lognormvariate(0, 0.1)
        ttft, itl = 0.020 * scale * noise, 0.010 * scale * rng.lognormvariate(0, 0.05)
        out.append(Sample((1,) * 16, ttft, itl, ttft + 15 * itl))
    return out


def verdict(baseline: list[Sample], candidate: list[Sample]) -> str:
    return decide([error_check(baseline, candidate, LIMITS), *latency_checks(baseline, candidate, LIMITS)])


def test_same_distribution_promotes_and_a_regression_rolls_back() -> None:
    assert verdict(samples(1.0, seed=1), samples(1.0, seed=2)) == "PROMOTE"
    assert verdict(samples(1.0, seed=1), samples(1.5, seed=2)) == "ROLL BACK"
    checks = latency_checks(samples(1.0, seed=1), samples(2.0, seed=2), LIMITS)
    assert [c.passed for c in checks] == [False, False, False]


def test_a_significant_but_small_difference_is_no_regression() -> None:
    # 3% slower on 2000 samples: p is tiny, but under the 20% effect floor.
    baseline, candidate = samples(1.0, n=2000, seed=1), samples(1.03, n=2000, seed=2)
    checks = latency_checks(baseline, candidate, LIMITS)
    assert all(c.passed for c in checks)
    assert "p=" in checks[2].candidate and float(checks[2].candidate.split("p=")[1].split(",")[0]) < 0.001


def test_too_few_samples_cannot_be_judged() -> None:
    checks = latency_checks(samples(1.0, n=10), samples(3.0, n=10), LIMITS)
    assert [c.passed for c in checks] == [None, None, None]
    assert decide(checks) == "CANNOT JUDGE"


def test_candidate_errors_roll_back() -> None:
    failed = [Sample(error="HTTP 500: device")] * 2
    check = error_check(samples(1.0), samples(1.0)[:-2] + failed, LIMITS)
    assert check.passed is False and check.detail == "candidate's first failed request: HTTP 500: device"


def test_agreement_is_with_each_sides_own_golden() -> None:
    old = GoldenSet((Prompt("Once", 3),), ((5, 6, 7),))
    new = GoldenSet((Prompt("Once", 3),), ((5, 9, 9),))  # a new model version answers differently
    new_answers = [Sample((5, 9, 9), 0.01, 0.01, 0.03)]
    assert agreement_check("candidate", agreement(new_answers, new.expected), LIMITS, True).passed
    wrong = agreement_check("candidate", agreement(new_answers, old.expected), LIMITS, True)
    assert wrong.passed is False and "golden prompt 0: expected [5, 6, 7]" in (wrong.detail or "")


def test_prompt_sources(tmp_path: Path) -> None:
    golden = Golden((GoldenPrompt("Once", (1, 9038), (263, 931, 2), ((),) * 3),))
    assert GoldenSet.of(golden) == GoldenSet((Prompt("Once", 3),), ((263, 931, 2),))
    extra = tmp_path / "prompts.txt"
    extra.write_text('The cat\n\n{"prompt": "The dog", "max_tokens": 4}\n')
    assert file_prompts(extra) == [Prompt("The cat", 16), Prompt("The dog", 4)]
    assert workload(file_prompts(extra), 5) == [Prompt("The cat", 16), Prompt("The dog", 4)] * 2 + [
        Prompt("The cat", 16)
    ]
    extra.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"prompts\.txt:1"):
        file_prompts(extra)


def _events(*tokens: int) -> str:
    lines = [
        f'data: {{"index": {i}, "token": {{"id": {t}, "text": "x", "special": false}}}}'
        for i, t in enumerate(tokens)
    ]
    return "\n\n".join(lines) + "\n\n"


def test_http_target_streams_token_ids_and_timings_with_key_and_track() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if b"boom" in request.content:
            return httpx.Response(503, json={"error": "draining"})
        if b"broken" in request.content:
            return httpx.Response(200, text='data: {"error": "device fault"}\n\n')
        return httpx.Response(200, text=_events(5, 6, 7), headers={"content-type": "text/event-stream"})

    async def run() -> list[Sample]:
        target = open_target("alb:http://balancer#canary", "secret", 5.0)
        assert isinstance(target, HttpTarget)
        target._client._transport = httpx.MockTransport(handler)
        try:
            return [await target.send(Prompt(p, 3)) for p in ("Once", "boom", "broken")]
        finally:
            await target.aclose()

    ok, refused, broken = asyncio.run(run())
    assert ok.token_ids == (5, 6, 7) and ok.ttft_s is not None and ok.itl_s is not None and ok.e2e_s
    assert refused.error == 'HTTP 503: {"error":"draining"}'
    assert broken.error == "StreamError: device fault"
    assert seen[0].url.path == "/invocations"
    assert seen[0].headers["authorization"] == "Bearer secret" and seen[0].headers[TRACK_HEADER] == "canary"
    assert json.loads(seen[0].content) == {
        "inputs": "Once",
        "parameters": {"max_new_tokens": 3},
        "stream": True,
    }


def test_sagemaker_target_reads_payload_parts_split_anywhere() -> None:
    class Runtime:
        def __init__(self) -> None:
            self.calls: list[dict] = []

        def invoke_endpoint_with_response_stream(self, **arguments: object) -> dict:
            self.calls.append(arguments)
            body = _events(11, 12).encode()
            return {"Body": [{"PayloadPart": {"Bytes": body[i : i + 7]}} for i in range(0, len(body), 7)]}

    runtime = Runtime()
    target = open_target("sagemaker:llm/canary", None, 5.0, sagemaker_client=lambda: runtime)
    assert isinstance(target, SageMakerTarget)
    sample = asyncio.run(target.send(Prompt("Once", 2)))
    assert sample.token_ids == (11, 12)
    assert runtime.calls[0]["EndpointName"] == "llm" and runtime.calls[0]["TargetVariant"] == "canary"


@pytest.mark.parametrize("spec", ["ftp://x", "alb:http://x#blue", "alb:x#canary", "sagemaker:"])
def test_bad_targets_are_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match="target"):
        open_target(spec, None, 5.0)


def test_unreachable_baseline_cannot_be_judged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    golden = tmp_path / "golden.json"
    golden.write_text(Golden((GoldenPrompt("Once", (1,), (5,), ((),)),)).dumps())
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = ["canary", "--baseline", url, "--candidate", url, "--candidate-golden", str(golden)]
    assert main([*argv, "--timeout", "5", "--samples", "4"]) == 2
    assert "cannot judge: the baseline answered none of 4 requests" in capsys.readouterr().err
