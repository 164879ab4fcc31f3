"""Errors as ``power serve`` answers them: :class:`APIError` (an OpenAI-shaped error body, its status and
headers) and the mapping of Power's own errors onto it.

Every error body has OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

import attrs
from starlette.responses import JSONResponse

from power_core.errors import (
    AdapterFault,
    ArtifactError,
    CapacityError,
    ConfigError,
    ConstraintError,
    PowerError,
    RuntimeFault,
)

__all__ = ["APIError", "constraint_error", "error_response", "from_power_error"]


@attrs.frozen
class APIError(Exception):
    """An error answered with an OpenAI-shaped body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


def constraint_error(exc: ConstraintError) -> APIError:
    """A 400 naming the request field a refused schema, grammar or tool definition came from."""
    field = exc.field
    code = ("invalid_grammar" if field.startswith("grammar") else
            "invalid_schema" if "schema" in field or field.endswith("parameters") else "invalid_value")
    return APIError(400, str(exc), param=field, code=code)


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` as an HTTP response: its status, OpenAI's error body and its headers."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def from_power_error(exc: BaseException) -> APIError:
    """The answer to one of Power's errors: a typed rejection is a 400 with its code, a fault a 500 with its
    message, and anything else a 500 without its details."""
    if isinstance(exc, ConstraintError):
        return constraint_error(exc)
    if isinstance(exc, (ConfigError, CapacityError, ArtifactError)):
        return APIError(400, f"{exc}", code=getattr(exc, "code", None))
    if isinstance(exc, PowerError) and not isinstance(exc, (RuntimeFault, AdapterFault)):
        return APIError(400, f"{exc}", code=exc.code)
    code = getattr(exc, "code", None) or "internal_error"
    message = f"{exc}" if isinstance(exc, PowerError) else "internal error; the server log has the details"
    return APIError(500, message, type="server_error", code=code)
