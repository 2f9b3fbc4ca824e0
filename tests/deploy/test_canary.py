"""The canary's verdict on canned samples (agreement with each side's own golden, the exact error test,
the paired signed-rank test on medians, the paired sign-flip tail checks, Holm's rule over them all,
their effect floors and minimum sample size), its prompt sources, its targets (streamed /invocations
parsed into token ids and timings, an API key and the ALB track header sent, SageMaker's event stream
read across PayloadPart boundaries) and where a verdict is published. Audit references:
shared/research/audit-deploy-2026-11-25.md, section 4."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import boto3
import httpx
import numpy as np
import pytest
from botocore.stub import Stubber

from app.artifacts.golden import Golden, GoldenPrompt
from app.cli import main
from app.errors import ConfigError
from deploy.canary.cli import client_timeout
from deploy.canary.publish import NAMESPACE, metric_data, publish
from deploy.canary.replay import LATENCY_TOKENS, GoldenSet, file_prompts, workload
from deploy.canary.targets import (
    TRACK_HEADER,
    HttpTarget,
    Prompt,
    SageMakerTarget,
    Sample,
    open_target,
    request_body,
)
from deploy.canary.verdict import (
    Check,
    Thresholds,
    agreement,
    agreement_check,
    decide,
    holm,
    sign_flip_p,
    statistical_checks,
)
from loadtest.harness.server import free_port

LIMITS = Thresholds(seed=0)


def sample(ttft: float, gaps: list[float]) -> Sample:
    return Sample((1,) * (len(gaps) + 1), ttft, sum(gaps) / len(gaps), ttft + sum(gaps), None, tuple(gaps))


def samples(scale: float, n: int = 64, seed: int = 0, tokens: int = 16) -> list[Sample]:
    """Lognormal-ish latencies around 20 ms TTFT, 10 ms per token, `tokens` tokens, times `scale`."""
    rng = random.Random(seed)
    return [
        sample(
            0.020 * scale * rng.lognormvariate(0, 0.1),
            [0.010 * scale * rng.lognormvariate(0, 0.05) for _ in range(tokens - 1)],
        )
        for _ in range(n)
    ]


def verdict(baseline: list[Sample], candidate: list[Sample]) -> str:
    return decide(statistical_checks(baseline, candidate, LIMITS))


def latency_checks(baseline: list[Sample], candidate: list[Sample], limits: Thresholds) -> list[Check]:
    """The latency checks as decided (Holm over the whole family, the error test included)."""
    return statistical_checks(baseline, candidate, limits)[1:]


def error_check(baseline: list[Sample], candidate: list[Sample], limits: Thresholds) -> Check:
    return statistical_checks(baseline, candidate, limits)[0]


def test_same_distribution_promotes_and_a_regression_rolls_back() -> None:
    assert verdict(samples(1.0, seed=1), samples(1.0, seed=2)) == "PROMOTE"
    assert verdict(samples(1.0, seed=1), samples(1.5, seed=2)) == "ROLL BACK"
    checks = latency_checks(samples(1.0, seed=1), samples(2.0, seed=2), LIMITS)
    assert [c.name for c in checks] == [
        "TTFT median",
        "TPOT median",
        "TTFT p95",
        "TTFT p99",
        "inter-token gap p95",
        "inter-token gap p99",
    ]
    # The 99th percentile of 64 TTFTs has ~1 pooled value above it a side: no test can reject on that.
    assert all(c.passed is False for c in checks if c.name != "TTFT p99")


def test_a_significant_but_small_difference_is_no_regression() -> None:
    # 3% slower on 2000 prompts: the signed-rank p is tiny, but under the 20% effect floor.
    baseline, candidate = samples(1.0, n=2000, seed=1, tokens=4), samples(1.03, n=2000, seed=2, tokens=4)
    checks = latency_checks(baseline, candidate, LIMITS)
    assert all(c.passed for c in checks)
    assert float(checks[1].candidate.split("p=")[1].rstrip(")")) < 0.001


def test_the_test_is_paired_on_prompts() -> None:
    # Audit 4.4: prompts of very different lengths; the candidate is 25% slower on every one of them.
    # Unpaired (the former Mann-Whitney), prompt-to-prompt variance swamps the effect; per-prompt
    # differences (Wilcoxon signed-rank) see it.
    rng = random.Random(3)
    scales = [rng.lognormvariate(0, 1) for _ in range(40)]
    baseline = [sample(0.02 * k, [0.01 * k] * 3) for k in scales]
    candidate = [sample(0.02 * k * 1.25 * rng.uniform(0.99, 1.01), [0.01 * k * 1.25] * 3) for k in scales]
    from scipy.stats import mannwhitneyu

    unpaired = mannwhitneyu(
        [s.ttft_s for s in candidate], [s.ttft_s for s in baseline], alternative="greater"
    )
    assert unpaired.pvalue > 0.05 / 3  # the old check's per-metric alpha: it saw nothing
    ttft = latency_checks(baseline, candidate, LIMITS)[0]
    assert ttft.name == "TTFT median" and ttft.passed is False


def test_a_tail_regression_does_not_pass() -> None:
    # Audit 4.5: 10% of requests stall (every gap 3x); the medians barely move, the tail must fail.
    baseline = samples(1.0, n=128, seed=1, tokens=32)
    candidate = samples(1.0, n=128, seed=2, tokens=32)
    candidate = [
        sample(s.ttft_s, [g * 3 for g in s.gaps_s]) if i % 10 == 0 else s for i, s in enumerate(candidate)
    ]
    checks = {c.name: c.passed for c in latency_checks(baseline, candidate, LIMITS)}
    assert checks["TPOT median"] is True and checks["TTFT median"] is True
    assert checks["inter-token gap p99"] is False
    assert verdict(baseline, candidate) == "ROLL BACK"


def test_a_tail_regression_under_its_floor_passes() -> None:
    # The minimum effect: every gap above the candidate's p97 5% slower is significant on 512 prompts
    # but under the 10% floor of the inter-token tails.
    baseline = samples(1.0, n=512, seed=1, tokens=32)
    candidate = samples(1.0, n=512, seed=2, tokens=32)
    cut = sorted(g for s in candidate for g in s.gaps_s)[int(0.97 * 512 * 31)]
    candidate = [sample(s.ttft_s, [g * 1.05 if g >= cut else g for g in s.gaps_s]) for s in candidate]
    tail = {c.name: c for c in latency_checks(baseline, candidate, LIMITS)}["inter-token gap p99"]
    assert tail.p is not None and tail.p < 0.01 and not tail.large and tail.passed is True


def test_the_tail_test_is_an_exact_paired_sign_flip() -> None:
    rng = np.random.default_rng(0)
    # 20 prompts all worse on the candidate: only the observed sign pattern (1 in 2^20) is as extreme.
    assert sign_flip_p(np.ones(20), 2000, rng) == pytest.approx(1 / 2001, abs=2 / 2001)
    # Symmetric differences are no evidence at all.
    assert sign_flip_p(np.array([2.0, -2.0, 1.0, -1.0]), 2000, rng) == 1.0
    # Under exchangeable sides (identical releases) the p-value is uniform: about 5% of random sign
    # patterns of the same differences fall under 0.05.
    differences = rng.poisson(1.0, size=128).astype(float)
    p_values = [sign_flip_p(differences * rng.choice((-1, 1), 128), 400, rng) for _ in range(400)]
    assert 0.02 < np.mean(np.array(p_values) < 0.05) < 0.09


def test_holm_shares_alpha_over_every_check() -> None:
    # Seven checks at alpha 0.05: Holm compares the smallest p with 0.05/7, the next with 0.05/6, ...
    # (Bonferroni would compare both with 0.05/7 and pass the second).
    ps = [0.006, 0.008, 0.5, 0.5, 0.5, 0.5, 0.5]
    checks = [Check(f"c{i}", "", "", "", True, p=p) for i, p in enumerate(ps)]
    assert [c.passed for c in holm(checks, 0.05)] == [False, False, True, True, True, True, True]
    # A p above its step (0.03 > 0.05/2) stops the rule, although it is under alpha.
    checks = [Check(f"c{i}", "", "", "", True, p=p) for i, p in enumerate([0.03, 0.04, 0.001])]
    assert [c.passed for c in holm(checks, 0.05)] == [True, True, False]
    # A rejected check whose effect is under its floor passes; one that cannot be judged stays so.
    small = Check("small", "", "", "", True, p=0.0001, large=False)
    unjudged = Check("few", "", "", "", None)
    assert [c.passed for c in holm([small, unjudged], 0.05)] == [True, None]


def test_too_few_samples_cannot_be_judged() -> None:
    checks = latency_checks(samples(1.0, n=10), samples(3.0, n=10), LIMITS)
    assert {c.passed for c in checks} == {None}
    assert decide(checks) == "CANNOT JUDGE"


def test_a_shared_background_error_rate_is_no_regression() -> None:
    # Audit 4.2: one more failed request than the baseline rolled back 21-30% of identical releases.
    # Exact binomial test against the baseline's rate + 3 points: 2 failures of 64 against 1 pass.
    base = [*samples(1.0)[:-1], Sample(error="HTTP 429")]
    cand = samples(1.0)[:-2] + [Sample(error="HTTP 429")] * 2
    assert error_check(base, cand, LIMITS).passed is True


def test_candidate_errors_roll_back() -> None:
    failed = [Sample(error="HTTP 500: device")] * 12
    check = error_check(samples(1.0), samples(1.0)[:-12] + failed, LIMITS)
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
    # Audit 4.6: the latency workload generates exactly max_new_tokens (at least 64) on both sides.
    assert LATENCY_TOKENS == 64  # 63 gaps a request: a p99 over 128 prompts rests on ~80 gaps a side
    exact = [Prompt("The cat", 64, ignore_eos=True), Prompt("The dog", 64, ignore_eos=True)]
    assert workload(file_prompts(extra), 5) == exact * 2 + exact[:1]
    assert request_body(exact[0])["parameters"] == {"max_new_tokens": 64, "ignore_eos": True}
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
    answer = asyncio.run(target.send(Prompt("Once", 2)))
    assert answer.token_ids == (11, 12) and len(answer.gaps_s) == 1
    assert runtime.calls[0]["EndpointName"] == "llm" and runtime.calls[0]["TargetVariant"] == "canary"
    assert "InferenceComponentName" not in runtime.calls[0]
    # Audit W9: an endpoint hosting inference components needs InferenceComponentName
    # (InvokeEndpointWithResponseStream API reference).
    component = open_target("sagemaker:llm#llm-model", None, 5.0, sagemaker_client=lambda: runtime)
    asyncio.run(component.send(Prompt("Once", 2)))
    assert (
        runtime.calls[1]["InferenceComponentName"] == "llm-model" and "TargetVariant" not in runtime.calls[1]
    )


def test_the_client_timeout_is_the_platforms() -> None:
    # Audit H8: AWS advises a 70 s socket timeout for SageMaker invocations (deploy/timeouts.py).
    assert client_timeout("http://a", "sagemaker:llm") == 70
    assert client_timeout("alb:http://a#stable", "alb:http://a#canary") == 310


def test_the_verdict_is_published_for_the_new_fleet() -> None:
    # Issue 26: the canary job publishes the metrics the SageMaker guardrail's alarms watch, per
    # EndpointConfigName (deployment-guardrails-configuration, "Monitor model latency on the new fleet").
    checks = latency_checks(samples(1.0, seed=1), samples(1.0, seed=2), LIMITS)
    data = {m["MetricName"]: m for m in metric_data(checks, 0, "llm", "llm-config-2")}
    assert {name: m["Value"] for name, m in data.items()} == {
        "Verdict": 0.0,
        "TTFTRegression": 0.0,
        "InterTokenRegression": 0.0,
    }
    assert data["Verdict"]["Dimensions"] == [
        {"Name": "EndpointName", "Value": "llm"},
        {"Name": "EndpointConfigName", "Value": "llm-config-2"},
    ]
    slower = latency_checks(samples(1.0, seed=1), samples(1.5, seed=2), LIMITS)
    client = boto3.client(
        "cloudwatch", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        expected = {"Namespace": NAMESPACE, "MetricData": metric_data(slower, 1, "llm", "llm-config-2")}
        stub.add_response("put_metric_data", {}, expected)
        publish(slower, 1, "llm/llm-config-2", client)
        stub.assert_no_pending_responses()
    values = {m["MetricName"]: m["Value"] for m in expected["MetricData"]}
    assert values == {"Verdict": 1.0, "TTFTRegression": 1.0, "InterTokenRegression": 1.0}


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
