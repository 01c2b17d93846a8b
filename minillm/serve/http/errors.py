"""OpenAI-shaped errors, and the gate every request passes first (API key, body size).

Every error answer is `{"error": {"message", "type", "param", "code"}}`. Validation failures are 400 and name the
field (FastAPI would answer 422 with its own shape); unknown routes are 404; bodies over the limit are 413.
"""
from __future__ import annotations

import re
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


class APIError(Exception):
    """Raised anywhere in a handler; answered as an OpenAI error object with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


# ---- validation errors -> 400 naming the field ----------------------------------------------------------------

# Fields whose type is a union: pydantic reports one error per member; one sentence reads better.
_UNION_HINTS = {"prompt": "a non-empty string, a list of strings, a list of token ids, or a list of token-id lists",
                "stop": "a string or a list of strings",
                "content": 'a string or a list of {"type": "text", "text": ...} parts'}
_TYPE_TAG = {"str", "int", "float", "bool", "list", "dict", "none"}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


def _path(loc) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (pydantic's union-member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _FIELD.match(part) and part not in _TYPE_TAG:
            out += f".{part}" if out else part
    return out


def validation_error(errors) -> APIError:
    """The first pydantic error as a 400 APIError whose param is the top-level body field."""
    err = errors[0]
    loc = [p for p in err["loc"] if p != "body"]
    kind = err["type"]
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc or not isinstance(loc[0], str):
        return APIError(400, "the request body must be a JSON object")
    param, path = loc[0], _path(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {path!r}", param=param)
    if kind == "missing":
        return APIError(400, f"{path} is required", param=param)
    for i, part in enumerate(loc[:-1]):   # an error inside a union member: name the union field instead
        if part in _UNION_HINTS and isinstance(loc[i + 1], str) and _path([loc[i + 1]]) == "":
            return APIError(400, f"{_path(loc[:i + 1])} must be {_UNION_HINTS[part]}", param=param)
    return APIError(400, f"{path}: {err['msg']}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


# ---- the gate: API key and body size, before any routing or parsing --------------------------------------------

class Gate:
    """Pure ASGI middleware (no per-chunk overhead on streamed responses, unlike BaseHTTPMiddleware).

    - With an API key, every /v1 route needs `Authorization: Bearer KEY` (401 otherwise); /health and /metrics
      stay open, as in vLLM.
    - A request body is read here, up to max_body_bytes, and replayed to the app; a longer one is read to its end
      and dropped (memory stays bounded and the client still gets a clean 413 rather than a reset connection).
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            err = APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            return await error_response(err)(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, size = await self._read_body(receive)
            if body is None:
                err = APIError(413, f"the request body is {size} bytes; the limit is {self.max_body_bytes} bytes",
                               code="request_too_large")
                return await error_response(err)(scope, receive, send)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return secrets.compare_digest(given, self.expected)

    async def _read_body(self, receive) -> tuple[bytes | None, int]:
        """(body, size), or (None, size) when it is over the limit; a disconnect ends the body early."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body_bytes:
                parts.append(chunk)
            else:
                parts.clear()
            if not message.get("more_body", False):
                break
        return (b"".join(parts) if size <= self.max_body_bytes else None), size


def _replay(body: bytes, receive):
    """A receive() that hands the app the buffered body once, then the connection's own messages (disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
