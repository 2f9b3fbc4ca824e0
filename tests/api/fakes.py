"""A deterministic stand-in engine and tokenizer, so the HTTP layer is tested without a model.

Tokenizer: one token per byte (id = byte + 3), BOS 1, EOS 2. Engine: the k-th generated token of a
request is the letter `"abcdefghijklmnopqrstuvwxyz"[(seed * greedy_off + prompt length + k) % 26]`, one
delta per token (the first carries prompt logprobs of -1.0 when asked for), `step_s` apart; stop
strings and max_tokens end it as the real engine does. `aborted` lists the ids `abort` was called with
(what `Job.close` owes a client gone), nothing else. It refuses the sampling features no backend has.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import AsyncIterator
from typing import ClassVar

import tokenizers

from app.api.state import Runtime
from app.backends.base import SampledToken, check_sampling
from app.engine.admission import Backlog
from app.engine.types import FinishReason, GenerationParams, RequestOutput, RequestTimings
from app.errors import InvalidRequestError
from app.shapes import ShapeGrid

BOS, EOS, OFFSET = 1, 2, 3
VOCAB_SIZE = 256 + OFFSET
GRID = ShapeGrid(4, 256, (64, 128), (128, 256), (1, 2, 4))


class FakeTokenizer:
    eos_token_ids = (EOS,)
    renders_tools = False
    vocab_size = VOCAB_SIZE
    tokenizer_class = "FakeTokenizer"
    special_tokens: ClassVar = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": None}
    chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    special_token_ids = frozenset({BOS, EOS})
    byte_fallback_ids = frozenset()
    max_token_chars = 1

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = True
    ) -> list[int]:
        prefix = [BOS] if add_special_tokens else []
        return prefix + [b + OFFSET for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def to_json(self) -> str:
        """This vocabulary as a Hugging Face tokenizer.json (a byte per token, after the three specials),
        for the grammar engine: a request with a grammar compiles one, as on a real tokenizer."""
        specials = ("<unk>", "<s>", "</s>")
        vocab = {
            **{name: i for i, name in enumerate(specials)},
            **{f"<0x{b:02X}>": b + OFFSET for b in range(256)},
        }
        tokenizer = tokenizers.Tokenizer(
            tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True)
        )
        tokenizer.decoder = tokenizers.decoders.ByteFallback()
        tokenizer.add_special_tokens([tokenizers.AddedToken(name, special=True) for name in specials])
        return tokenizer.to_str()

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, template_kwargs=None
    ) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def expected_text(prompt_len: int, max_tokens: int, seed: int = 0, greedy: bool = True) -> str:
    start = prompt_len + (0 if greedy else seed)
    return "".join(string.ascii_lowercase[(start + k) % 26] for k in range(max_tokens))


class FakeEngine:
    """The engine contract (`EngineClient`) over canned letters; it measures nothing, so admission and
    the drain take every request (`expected_time_s` is None)."""

    eos_token_ids = frozenset({EOS})

    def __init__(self, step_s: float = 0.0, vocab_size: int = VOCAB_SIZE) -> None:
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.fail_with: Exception | None = None  # raised by `generate` (admission errors, bugs)
        self.reject_with: Exception | None = None  # raised by `check_request` (what the backend lacks)
        self.requests: dict[str, GenerationParams] = {}
        self.aborted: list[str] = []
        self.prefix_cache_resets = 0
        self.finished: list[str] = []
        self.is_alive = True
        self.is_ready = True

    @property
    def num_unfinished(self) -> int:
        return len(self.requests) - len(self.finished)

    def backlog(self) -> Backlog:
        return Backlog(GRID.num_slots, GRID.num_slots, 0, 0, 1.0, 0.0)

    def expected_time_s(self, max_tokens: int) -> float | None:
        return None

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[RequestOutput]:
        if self.fail_with is not None:
            raise self.fail_with
        self.requests[request_id] = params
        return self._run(request_id, prompt_token_ids, params)

    def check_request(self, prompt_token_ids: list[int], params: GenerationParams) -> None:
        if self.reject_with is not None:
            raise self.reject_with
        check_sampling(params.sampling, self.vocab_size, frozenset({"prompt_logprobs"}), "fake")
        if not all(0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("a token id is outside the vocabulary", param="prompt")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    async def _run(
        self, request_id: str, prompt: list[int], params: GenerationParams
    ) -> AsyncIterator[RequestOutput]:
        greedy = params.sampling.temperature == 0
        letters = expected_text(len(prompt), params.max_tokens, params.sampling.seed, greedy)
        text = ""
        for k, letter in enumerate(letters):
            await asyncio.sleep(self.step_s)
            token = ord(letter) + OFFSET
            text += letter
            reason = None
            stop = next((s for s in params.stop_strings if s in text), None)
            delta = letter
            if stop is not None:  # the fake holds nothing back: use one-letter stop strings
                delta = text[len(text) - 1 : text.index(stop)]
                reason = FinishReason.STOP
            elif k + 1 == params.max_tokens:
                reason = FinishReason.LENGTH
            top = tuple((token + i, -0.5 - i) for i in range(params.sampling.num_top_logprobs))
            done = reason is not None
            yield RequestOutput(
                request_id=request_id,
                token_ids=(token,),
                text=delta,
                samples=(SampledToken(token, -0.5, top, prompt_samples(prompt, params) if k == 0 else None),),
                num_prompt_tokens=len(prompt),
                num_generated_tokens=k + 1,
                finished=done,
                finish_reason=reason,
                timings=RequestTimings(
                    0.001, 0.002 + self.step_s, 0.003 + (k + 1) * self.step_s if done else None
                ),
            )
            if done:
                self.finished.append(request_id)
                return


def prompt_samples(prompt: list[int], params: GenerationParams) -> tuple[SampledToken, ...] | None:
    """Prompt logprobs: -1.0 for every prompt token after the first, alternatives as for outputs."""
    num_top = params.sampling.prompt_logprobs
    if num_top is None:
        return None
    return tuple(SampledToken(t, -1.0, tuple((t + i, -1.0 - i) for i in range(num_top))) for t in prompt[1:])


def fake_runtime(engine: FakeEngine | None = None) -> Runtime:
    return Runtime(
        engine=engine or FakeEngine(),
        tokenizer=FakeTokenizer(),  # type: ignore[arg-type]
        model_name="fake-model",
        artifact_id="fake-model/0123456789ab",
        backend_name="sim",
        grid=GRID,
        close=lambda: None,
    )
