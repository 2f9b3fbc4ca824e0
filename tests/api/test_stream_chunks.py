"""A streamed chunk that carries only text is written from halves rendered once per choice: the same
bytes as the chunk built and serialized as a model, whatever the text."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from app.api.openai import ChatRenderer, CompletionRenderer, OpenAIRenderer
from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.validation import Api, Validated
from app.engine.types import RequestOutput

TEXTS = [
    "plain",
    "",
    'a "quote" and \\ backslash',
    "new\nline\ttab\r\x00\x1f\x7f",
    "é 😀 \u2028 \ue000",
    "{}[]:,",
]


def renderer(kind: type[OpenAIRenderer], api: Api, body: dict[str, Any]) -> OpenAIRenderer:
    request = (CompletionRequest if api is Api.COMPLETION else ChatCompletionRequest).model_validate(body)
    validated = Validated(api, request, [], [])
    serving = SimpleNamespace(model_name='m"odel', artifact_id="art", tool_call_parser=None)
    job = SimpleNamespace(choices=[])
    return kind(serving, "req", validated, job)  # type: ignore[arg-type]


def delta(text: str, generated: int) -> RequestOutput:
    return RequestOutput("r", (5,), text, (), 3, generated)


@pytest.mark.parametrize(
    ("kind", "api", "body"),
    [
        (CompletionRenderer, Api.COMPLETION, {"model": "m", "prompt": "x", "stream": True}),
        (
            ChatRenderer,
            Api.CHAT,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
        ),
    ],
)
def test_text_chunks_are_the_bytes_of_the_model_chunk(
    kind: type[OpenAIRenderer], api: Api, body: dict
) -> None:
    fast = renderer(kind, api, body)
    built = renderer(kind, api, body)
    first = delta("first", 1)
    assert fast.delta(1, first) == built.chunk(1, first)  # the first chunk of a choice (a role, an echo)
    for generated, text in enumerate(TEXTS, start=2):
        out = delta(text, generated)
        assert fast.text_only(1)
        assert fast.delta(1, out) == built.chunk(1, out)
    assert fast.text_chunks[1] is not None  # the halves were used
