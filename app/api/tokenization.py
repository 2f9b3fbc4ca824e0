"""vLLM's tokenizer routes: `/tokenize` (a prompt, or chat messages through the chat template, with the
`add_special_tokens` and `add_generation_prompt` flags), `/detokenize` and `/tokenizer_info`.

Bodies pass the checks a generation request's do (raw-body counts, strict JSON types, the model's name,
the character bound before tokenizing); `Serving.run` runs them on the validation threads.
"""

from __future__ import annotations

from collections.abc import Callable

from app.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from app.api.validation import Validator, parse, parse_json
from app.errors import InvalidRequestError


def tokenize(validator: Validator, raw: bytes, token_text: Callable[[int], str]) -> TokenizeResponse:
    """`token_strs` are each token's text as the server decodes it in logprobs."""
    validator.limits.refuse_long_arrays(raw)
    body = parse_json(raw)
    request = parse(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
    validator.check_model(request.model)
    if isinstance(request, TokenizeChatRequest):
        if request.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message is not supported by this server", param="continue_final_message"
            )
        token_ids = validator.chat_prompt(request)
    else:
        limits, tokenizer = validator.limits, validator.tokenizer
        limits.check_chars(len(request.prompt), tokenizer.max_token_chars, "prompt")
        token_ids = tokenizer.encode(request.prompt, request.add_special_tokens, request.split_special_tokens)
    return TokenizeResponse(
        count=len(token_ids),
        max_model_len=validator.limits.max_positions,
        tokens=token_ids,
        token_strs=[token_text(t) for t in token_ids] if request.return_token_strs else None,
    )


def detokenize(validator: Validator, raw: bytes) -> DetokenizeResponse:
    validator.limits.refuse_long_arrays(raw)
    request = parse(DetokenizeRequest, parse_json(raw))
    validator.check_model(request.model)
    vocab_size = validator.tokenizer.vocab_size
    outside = [t for t in request.tokens if t >= vocab_size]
    if outside:
        raise InvalidRequestError(
            f"token id {outside[0]} is outside the vocabulary ({vocab_size} tokens)", param="tokens"
        )
    # NOTE: special tokens kept, as vLLM's (transformers' decode default), so text round-trips.
    return DetokenizeResponse(prompt=validator.tokenizer.decode(request.tokens, skip_special_tokens=False))


def tokenizer_info(validator: Validator) -> TokenizerInfo:
    tokenizer = validator.tokenizer
    return TokenizerInfo(
        tokenizer_class=tokenizer.tokenizer_class,
        **tokenizer.special_tokens,
        chat_template=tokenizer.chat_template,
        model_max_length=validator.limits.max_positions,
    )
