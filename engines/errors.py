"""Error types shared by every layer; `server.errors` maps them to HTTP responses."""


class TandemError(Exception):
    """Base class for errors that carry a message meant for the API client."""


class InvalidRequest(TandemError):
    """The request is well-formed JSON but asks for something we cannot do."""


class ContextTooLong(InvalidRequest):
    """Prompt (plus requested tokens) does not fit the model's context window."""


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
