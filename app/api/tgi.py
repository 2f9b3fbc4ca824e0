"""The `{"inputs", "parameters", "stream"}` body that TGI and LMI containers take on SageMaker, and TGI
takes at its own routes (`POST /`, `/generate`, `/generate_stream`).

As TGI answers it: a JSON array `[{"generated_text", "details"?}]`, the object alone at `/generate`
(`details`: the finish reason, the number of tokens, the seed, `prefill` and each generated token as
`{"id", "text", "logprob", "special"}`), or with `stream` server-sent events, one per token
(`{"index", "token", "generated_text", "details"}`), the last carrying the whole `generated_text` and
`details` (without the token lists, as TGI's).
Sampling follows TGI: greedy unless `do_sample` or a sampling parameter (`temperature` != 1, `top_k`,
`top_p` < 1, `typical_p` < 1) is set; `typical_p` cuts what top-k and top-p keep, as TGI's warpers.
A stop sequence ends the text it stopped, as TGI's `generated_text` keeps it.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from app.api import streaming
from app.api.auth import presented_key
from app.api.protocol import (
    GenerateDetails,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamDetails,
    GenerateStreamEvent,
    GenerateToken,
)
from app.api.serving import ChoiceOutput, Job, Serving
from app.api.validation import Validated
from app.backends.base import SampledToken
from app.engine.types import FinishReason, RequestOutput


class GenerateRenderer:
    def __init__(self, serving: Serving, job: Job, validated: Validated, listed: bool = True) -> None:
        assert isinstance(validated.body, GenerateRequest)
        self.listed = listed
        self.eos_token_ids = serving.engine.eos_token_ids
        self.special_token_ids = serving.tokenizer.special_token_ids
        self.token_text = serving.token_text
        self.job = job
        self.details_wanted = validated.body.parameters.details
        self.prefix = "".join(validated.prompt_texts)
        self.sampled = job.requests[0].params.sampling.temperature > 0

    def finish_reason(self, output: ChoiceOutput) -> str:
        """TGI's names: length, eos_token or stop_sequence."""
        if output.finish_reason == FinishReason.STOP:
            last = output.token_ids[-1] if output.token_ids else None
            return "eos_token" if last in self.eos_token_ids else "stop_sequence"
        return str(output.finish_reason)

    def stream_details(self, output: ChoiceOutput) -> GenerateStreamDetails:
        return GenerateStreamDetails(
            finish_reason=self.finish_reason(output),
            generated_tokens=output.num_generated_tokens,
            seed=output.seed if self.sampled else None,
        )

    def details(self, output: ChoiceOutput) -> GenerateDetails:
        """A whole body's details: each generated token with its own text, as TGI lists them."""
        tokens = [self.token(sample, self.token_text(sample.token_id)) for sample in output.samples]
        return GenerateDetails(**self.stream_details(output).model_dump(), prefill=[], tokens=tokens)

    def token(self, sample: SampledToken, text: str) -> GenerateToken:
        special = sample.token_id in self.special_token_ids
        return GenerateToken(id=sample.token_id, text=text, logprob=sample.logprob, special=special)

    def delta(self, index: int, out: RequestOutput) -> bytes:
        tokens: list[GenerateToken | None] = [self.token(s, "") for s in out.samples] or [None]
        if tokens[-1] is not None:
            tokens[-1].text = out.text
        events = [GenerateStreamEvent(index=index, token=token) for token in tokens]
        if out.finished:
            output = self.job.choices[index]
            events[-1].generated_text = self.prefix + output.text
            events[-1].details = self.stream_details(output)
        return b"".join(streaming.sse(event.model_dump_json()) for event in events)

    def end(self, job: Job) -> bytes:
        return b""

    def body(self, job: Job) -> bytes:
        output = job.choices[0]
        details = self.details(output) if self.details_wanted else None
        response = GenerateResponse(generated_text=self.prefix + output.text, details=details)
        omitted = {"details"} if details is None else None  # as TGI: no details unless asked
        answer = response.model_dump_json(exclude=omitted).encode()
        return b"[" + answer + b"]" if self.listed else answer


async def generate(
    serving: Serving, validated: Validated, request: Request, request_id: str, listed: bool = True
) -> Response:
    """The answer to a TGI body: events where it streams, else its generation, in a list of one where
    `listed` (`/invocations` and TGI's `POST /`, as Hugging Face's inference API answers) or alone (TGI's
    `/generate`)."""
    job = serving.start(request_id, validated.requests, presented_key(request))
    renderer = GenerateRenderer(serving, job, validated, listed)
    return await streaming.respond(request, job, renderer, validated.stream)
