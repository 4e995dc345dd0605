"""Error types shared by every layer; `server.errors` maps them to HTTP responses."""


class TandemError(Exception):
    """Base class for errors that carry a message meant for the API client."""


class InvalidRequest(TandemError):
    """The request is well-formed JSON but asks for something we cannot do."""


class ContextTooLong(InvalidRequest):
    """Prompt (plus requested tokens) does not fit the model's context window. The
    counts travel with it so each API can word the refusal as its clients detect it."""

    def __init__(self, prompt_tokens: int, context: int, requested: int = 0) -> None:
        super().__init__(
            f"this model's context is {context} tokens; the prompt has {prompt_tokens}"
            + (f" and max_tokens asks for {requested} more" if requested else "")
        )
        self.prompt_tokens, self.context, self.requested = prompt_tokens, context, requested


class QueueFull(TandemError):
    """The waiting queue is at its bound; the client should retry later."""


class ServerNotReady(TandemError):
    """The model is still loading, the server is shutting down, or the engine died."""


class DraftIncompatible(TandemError):
    """The draft model cannot propose tokens for the target (vocabulary/tokenizer differ)."""


class RequestFailed(TandemError):
    """Serving one request raised; only that request fails."""


class RequestAborted(TandemError):
    """The server ended the request itself (shutdown, timeout, engine failure)."""


class RequestTimeout(RequestAborted):
    """The request ran past --request-timeout."""
