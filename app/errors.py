"""The one error taxonomy. Every failure a client or operator can see is one of these classes; the
HTTP layer maps each to a status code in one place (`app/api/errors.py`), and the CLI prints
`message` and exits non-zero."""

from __future__ import annotations


class Inf2ServeError(Exception):
    """Base class: `message` is safe to show a client or operator as is."""

    status_code = 500
    error_type = "internal_error"
    code: str | None = None  # OpenAI's error code where it has one for the case; else the status is sent

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled whole (replica processes send errors to the front): subclasses take extra arguments.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[Inf2ServeError], args: tuple[object, ...], state: dict[str, object]) -> Inf2ServeError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidRequestError(Inf2ServeError):
    """The request is malformed or asks for something the server cannot honour (names the limit)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt with the output asked for, does not fit the model's positions. OpenAI
    answers this with the code `context_length_exceeded` and a message that begins with the words below,
    and clients match either (LangChain, DSPy, LiteLLM, CrewAI) to shorten a conversation and retry,
    or to fall back to a larger model: `problem` says what did not fit, and which limit."""

    code = "context_length_exceeded"

    def __init__(self, max_positions: int, problem: str, param: str | None) -> None:
        super().__init__(
            f"This model's maximum context length is {max_positions} tokens. However, {problem}", param
        )


class AuthenticationError(Inf2ServeError):
    """No key, or a wrong one (`invalid_token`): answered with a `WWW-Authenticate` challenge."""

    status_code = 401
    error_type = "authentication_error"

    def __init__(self, message: str, invalid_token: bool = False) -> None:
        super().__init__(message)
        self.invalid_token = invalid_token


class NotFoundError(Inf2ServeError):
    status_code = 404
    error_type = "not_found_error"


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413


class RequestTimeoutError(InvalidRequestError):
    """The client took too long to send its request; the connection is closed after the answer."""

    status_code = 408


class OverloadedError(Inf2ServeError):
    """The waiting queue is full; `retry_after_s` estimates when a slot frees up."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReadyError(Inf2ServeError):
    """Still starting up, or draining, or stopped before the request finished: try again (elsewhere)."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1.0


class ReplicaLostError(Inf2ServeError):
    """The replica process serving a request died after the request's first output went out, so it
    cannot be moved to another replica; the request may be sent again."""

    status_code = 503
    error_type = "service_unavailable"


class DeadlineExceededError(Inf2ServeError):
    status_code = 504
    error_type = "timeout"


class GenerationError(Inf2ServeError):
    """A device step failed for the requests in it; the engine keeps serving the others."""

    status_code = 500
    error_type = "generation_error"


class BatchError(GenerationError):
    """A batch outside what the compiled model runs (`app.backends.batches`): an engine bug, never a
    client's, so it fails the step's requests like any failed step."""


class ConfigError(Inf2ServeError):
    """Bad settings, checkpoint, bucket grid or compile options: raised before any work starts."""

    error_type = "config_error"


class ArtifactError(Inf2ServeError):
    """An artifact is missing, corrupt, of an unknown schema, or does not match the running stack."""

    error_type = "artifact_error"


class StorageError(Inf2ServeError):
    """S3 or local storage failed (unreachable, access denied, missing key, disk full)."""

    error_type = "storage_error"
