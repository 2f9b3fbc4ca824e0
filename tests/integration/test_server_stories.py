"""The real server (torch backend, stories260K) started as SageMaker starts it, driven over loopback by
the official `openai` client, SageMaker's routes, and Prometheus' own parser and linter."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from loadtest.client import server_timing
from loadtest.harness.server import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def client(sagemaker_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=sagemaker_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(stories260k):
    """transformers' greedy continuation of PROMPT: (prompt token count, text after the prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    output = model.generate(input_ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    full = tokenizer.decode(output[0], skip_special_tokens=True)
    prompt_text = tokenizer.decode(input_ids[0], skip_special_tokens=True)
    return input_ids.shape[1], full[len(prompt_text) :], output.shape[1] - input_ids.shape[1]


def test_greedy_completion_equals_transformers_generate(client, reference):
    prompt_tokens, text, generated = reference
    completion = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0)
    assert completion.choices[0].text == text
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.completion_tokens == generated
    assert (
        completion.system_fingerprint == completion.model + "/" + completion.system_fingerprint.split("/")[1]
    )


def test_streamed_completion_equals_the_whole_one(client, reference):
    stream = client.completions.create(
        model="stories260K",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[1]
    assert chunks[-1].usage.completion_tokens == reference[2]


def test_chat_streamed_and_whole_agree(client):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.choices[0].message.content.strip()
    assert whole.usage.completion_tokens == 16


def test_stop_string_cuts_the_text(client, reference):
    text = reference[1]
    stop = text.split()[3]
    completion = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert completion.choices[0].text == text[: text.index(stop)]
    assert completion.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed):
        return [
            c.text
            for c in client.completions.create(
                model="stories260K", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed, n=2
            ).choices
        ]

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first[0] != first[1]
    assert first != other


def test_logprobs(client):
    completion = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == completion.choices[0].text  # each token's leading space kept
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely
    chat = client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,  # sampled, the end of text (logprob about -8 here) could end it before 3 tokens
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_refusals_from_the_real_engine(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="stories260K", prompt=[1, 600], max_tokens=2)
    assert "vocabulary" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=5, logit_bias={"600": 1})
    assert error.value.body["param"] == "logit_bias"


def test_invocations_bodies(sagemaker_server, reference):
    url = sagemaker_server.url + "/invocations"
    generated = httpx.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 24}}, timeout=60)
    assert generated.json() == [{"generated_text": reference[1]}]
    chat = httpx.post(
        url, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=60
    )
    assert chat.json()["object"] == "chat.completion"
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 24}, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "chunked" in response.headers.get("transfer-encoding", "")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["generated_text"] == reference[1]


def test_tgi_text_ends_with_the_stop_sequence(sagemaker_server, reference):
    """TGI's `generated_text` keeps the stop sequence it stopped at (huggingface_hub's own example:
    `stop=["Republic"]` gives "... the French Republic"); OpenAI's text ends before it."""
    stop = reference[1].split()[2]  # the greedy continuation's third word
    url = sagemaker_server.url + "/invocations"
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 24, "stop": [stop]}}
    generated = httpx.post(url, json=body, timeout=60).json()[0]["generated_text"]
    assert generated == reference[1][: reference[1].index(stop) + len(stop)]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == generated


def test_tgi_typical_p_is_transformers_typical_sampling(sagemaker_server, stories260k):
    """TGI's typical_p (langchain-huggingface's HuggingFaceEndpoint sends 0.95 by default) samples, cut as
    transformers' `TypicalLogitsWarper` cuts: with a mass so small that each step keeps the one token
    whose surprise is nearest the entropy, the text is transformers' own, and not its greedy one."""
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    output = model.generate(input_ids, max_new_tokens=16, do_sample=True, typical_p=1e-3, pad_token_id=0)
    expected = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    url = sagemaker_server.url + "/invocations"
    parameters = {"max_new_tokens": 16, "typical_p": 1e-3, "details": True}
    typical = httpx.post(url, json={"inputs": PROMPT, "parameters": parameters}, timeout=60).json()[0]
    assert expected.strip()
    assert typical["generated_text"].strip() == expected.strip()
    assert "seed" in typical["details"]  # sampled, as TGI samples with any warper
    greedy = httpx.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 16}}, timeout=60)
    assert greedy.json()[0]["generated_text"] != typical["generated_text"]
    langchain = {"max_new_tokens": 16, "top_p": 0.95, "typical_p": 0.95, "temperature": 0.8, "seed": 3}
    assert httpx.post(url, json={"inputs": PROMPT, "parameters": langchain}, timeout=60).status_code == 200


def complete_with_request_id(server: ServerProcess, request_id: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3},
        headers={"x-request-id": request_id},
        timeout=60,
    )


def test_ping_and_headers(sagemaker_server):
    ping = httpx.get(sagemaker_server.url + "/ping")
    assert ping.status_code == 200 and ping.content == b""
    response = complete_with_request_id(sagemaker_server, "integration-headers-check")
    assert response.headers["x-request-id"] == "integration-headers-check"
    assert response.headers["x-artifact-id"].startswith("stories260K/")
    timing = server_timing(response.headers["server-timing"])
    assert set(timing) == {"queue", "ttft", "total"}
    assert timing["queue"] <= timing["ttft"] <= timing["total"]


def test_logs_are_json_with_the_request_id(sagemaker_server):
    complete_with_request_id(sagemaker_server, "integration-log-check")
    access = sagemaker_server.wait_for_log(
        lambda line: line.get("request_id") == "integration-log-check" and line.get("msg") == "request"
    )
    assert access[-1]["status"] == 200 and access[-1]["path"] == "/v1/completions"
    lines = sagemaker_server.log_lines()
    assert all("unparsed" not in line for line in lines), [line for line in lines if "unparsed" in line][:3]
    phases = {line["phase"] for line in lines if line.get("msg") == "startup phase done"}
    assert {"resolve", "verify", "backend", "warmup", "golden", "engine"} <= phases


def test_metrics_parse_and_pass_promtool(sagemaker_server):
    text = httpx.get(sagemaker_server.url + "/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    ttft = families["inf2serve_time_to_first_token_seconds"]
    assert any(s.name.endswith("_count") and s.value > 0 for s in ttft.samples)
    phases = {s.labels["phase"] for s in families["inf2serve_startup_phase_seconds"].samples}
    assert {"backend", "warmup", "golden"} <= phases
    assert families["inf2serve_ready"].samples[0].value == 1
    # Without a Neuron device the utilization gauge carries the engine's busy fraction, labelled so.
    utilization = families["inf2serve_neuroncore_utilization_ratio"].samples
    assert [s.labels for s in utilization] == [{"core": "all", "source": "engine", "replica": "0"}]
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make system-deps` installs Debian's prometheus package"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_prompt_logprobs_equal_transformers(client, stories260k):
    """Loglikelihood scoring as lm-evaluation-harness asks for it (echo, logprobs, max_tokens 0), against
    transformers' fp32 forward pass over the whole prompt."""
    import torch

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids).logits[0, :-1].float(), dim=-1)
    expected = logprobs.gather(1, input_ids[0, 1:, None]).squeeze(1).tolist()
    scored = client.completions.create(
        model="stories260K", prompt=input_ids[0].tolist(), max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    best = [max(top.values()) for top in choice.logprobs.top_logprobs[1:]]
    assert best == pytest.approx(logprobs.max(dim=-1).values.tolist(), abs=1e-4)
    assert choice.text == tokenizer.decode(input_ids[0], skip_special_tokens=True)
    assert scored.usage.completion_tokens == 0
    generated = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0
    ).choices[0]
    assert generated.logprobs.token_logprobs[1 : input_ids.shape[1]] == pytest.approx(expected, abs=1e-4)
    assert len(generated.logprobs.tokens) == input_ids.shape[1] + 3
