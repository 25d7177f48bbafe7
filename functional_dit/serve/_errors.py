"""The server's error answers: `BadRequest` (a 400 naming its field) and `error`, OpenAI's
body ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from starlette.responses import JSONResponse

KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
KINDS |= {409: "conflict_error", 429: "rate_limit_exceeded"}


class BadRequest(ValueError):
    """A 400: ``field``, and a message naming the expected and the actual value."""

    def __init__(self, field: str, expected: str, actual):
        super().__init__(f"{field}: expected {expected}, got {actual!r}")
        self.field = field


def error(status: int, message: str, param=None, headers=None, extra=None) -> JSONResponse:
    """OpenAI's error body; ``extra``: more fields of the error object (a 504's steps done)."""
    body = {"message": message, "type": KINDS.get(status, "server_error"), "param": param, "code": status}
    return JSONResponse({"error": body | (extra or {})}, status_code=status, headers=headers)
