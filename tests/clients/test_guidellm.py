"""GuideLLM (vLLM's benchmark client), unmodified, against the real server on stories260K: synthetic
prompts of a fixed token length at a constant request rate, streamed through its default route,
`/v1/chat/completions`. It sends vLLM's extensions `ignore_eos`, `stop: null` and
`stream_options.continuous_usage_stats`, and counts tokens from the usage the server reports."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from loadtest.harness.server import BIN

pytestmark = pytest.mark.slow

NUM_REQUESTS = 6
PROMPT_TOKENS = 24
OUTPUT_TOKENS = 8


def test_guidellm_benchmark_succeeds_with_exact_token_counts(stories_server, stories260k, tmp_path):
    out = tmp_path / "guidellm.json"
    argv = [str(BIN / "guidellm"), "run"]
    argv += ["--backend", f"kind=openai_http,target={stories_server.url}"]
    argv += ["--profile", "kind=constant,rate=8", "--constraint", f"kind=max_requests,count={NUM_REQUESTS}"]
    argv += ["--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"]
    argv += ["--tokenizer", f"kind=hf_auto,model={stories260k}", "--output", f"kind=json,path={out}"]
    argv += ["--disable-console"]
    # One worker process (the default spawns ten on this 2-core machine); no hub: the tokenizer is local.
    env = {
        **os.environ,
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    benchmark = json.loads(out.read_text())["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    errors = [r["info"].get("error") for r in benchmark["requests"]["errored"]][:3]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (NUM_REQUESTS, 0, 0), errors
    metrics = benchmark["metrics"]
    assert metrics["output_token_count"]["successful"]["total_sum"] == NUM_REQUESTS * OUTPUT_TOKENS
    prompt_tokens = [r["prompt_tokens"] for r in benchmark["requests"]["successful"]]
    assert len(prompt_tokens) == NUM_REQUESTS and all(count >= PROMPT_TOKENS for count in prompt_tokens)
    assert metrics["time_to_first_token_ms"]["successful"]["count"] == NUM_REQUESTS
