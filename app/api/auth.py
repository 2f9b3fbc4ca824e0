"""API keys: who may call the inference routes when keys are configured (`ServerSettings.api_keys`).

A key comes as `Authorization: Bearer <key>`, or, behind SageMaker (whose InvokeEndpoint does not
forward `Authorization`), as `api_key=<key>` among the `;`-separated custom attributes that
InvokeEndpoint forwards as the `X-Amzn-SageMaker-Custom-Attributes` header. Every configured key is
compared in constant time, so timing reveals nothing. A refusal is a 401 with `WWW-Authenticate`.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from app.errors import AuthenticationError

CUSTOM_ATTRIBUTES_HEADER = "x-amzn-sagemaker-custom-attributes"
CUSTOM_ATTRIBUTE_KEY = "api_key"


def presented_key(request: Request) -> str | None:
    """The key the request presents: its bearer token, else its SageMaker custom attribute."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for attribute in request.headers.get(CUSTOM_ATTRIBUTES_HEADER, "").split(";"):
        name, _, value = attribute.partition("=")
        if name.strip() == CUSTOM_ATTRIBUTE_KEY and value.strip():
            return value.strip()
    return None


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    matched = False
    for key in keys:  # every key compared, so the time taken does not depend on which one matched
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched


async def require_api_key(request: Request) -> None:
    keys: tuple[str, ...] = request.app.state.settings.api_keys
    if not keys:
        return
    presented = presented_key(request)
    if presented is None or not key_matches(presented, keys):
        raise AuthenticationError(
            "missing or invalid API key (send Authorization: Bearer <key>, or behind SageMaker the custom "
            f"attribute {CUSTOM_ATTRIBUTE_KEY}=<key>)",
            invalid_token=presented is not None,
        )
