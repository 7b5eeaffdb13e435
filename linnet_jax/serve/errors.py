"""The app's errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, its API key check and its
body-size limit.

`APIError` is an answer with a status; `request_error` turns what the engine, its inputs or the tokenizer
refused into a 400 naming the field (a `linnet_jax.inputs.RequestError` carries it); `validation_error` does
the same for a body that pydantic refused; `BearerAuth` answers 401 without the API key; `BodyLimit` answers 413
for a body over the limit.
"""

import hmac
import json

import jinja2
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from linnet_jax.inputs import RequestError

ERROR_TYPES = {429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}  # else invalid_request_error
MAX_REQUEST_BYTES = 1 << 20  # the default body-size limit: many times what --max-len 640 and 16 slots need
BAD_INPUT = (ValueError, TypeError, OverflowError, jinja2.TemplateError)  # what the inputs or the tokenizer refuse
TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped, so that text holding a lone surrogate is still sent."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_body(error: APIError) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": error.message, "type": ERROR_TYPES.get(error.status, "invalid_request_error"),
                      "param": error.param, "code": error.code}}


def error_response(error: APIError) -> Response:
    return ASCIIJSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error of a request body, as a 400 naming the field (`messages[0].content`)."""
    first = exc.errors()[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    param = field_path(loc)
    where = f"{param}: " if param else "the request body: "
    return APIError(400, where + str(first.get("msg")), param)


def field_path(loc: list) -> str | None:
    """A pydantic error location as a field path (`messages[0].content`), without union member tags."""
    if not loc or not isinstance(loc[0], str):
        return None
    path = loc[0]
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in TYPE_TAGS:
            path += f".{part}"
        else:
            break
    return path


def request_error(error: Exception, prompt_field: str, renamed: dict[str, str] | None = None) -> APIError:
    """A refused input (BAD_INPUT) as a 400 naming its field: a RequestError's own field (or the body's name for
    it in `renamed`), its prompt as the endpoint's `prompt_field`; anything else (the tokenizer's or the chat
    template's errors) is the prompt's."""
    field = error.field if isinstance(error, RequestError) and error.field != "prompt" else prompt_field
    field = (renamed or {}).get(field, field)
    return APIError(400, " ".join(str(error).split()), field)


def check_api_key(key: str | None, name: str = "api_key") -> None:
    """A ValueError naming `name` unless key is None (no key needed) or a non-empty string without surrounding
    whitespace: an empty key would let `Authorization: Bearer` with no token in."""
    if key is not None and (not key or key != key.strip()):
        raise ValueError(f"{name} must be a non-empty string without surrounding whitespace, got {key!r}")


def authorized(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer key` (compared in constant time)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer KEY` (else 401)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" \
                and not authorized(Headers(scope=scope).get("authorization"), self.key):
            response = error_response(APIError(401, "a valid API key is needed: Authorization: Bearer KEY",
                                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request whose body holds more than `limit` bytes is answered 413 (once the body has been
    read to its end, and dropped, so that a client still sending it reads the answer); others reach the app."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size <= self.limit:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if size > self.limit:
            response = error_response(APIError(413, f"the request body holds {size} bytes; this server takes at most "
                                                    f"{self.limit} (--max-request-bytes)", code="request_too_large"))
            return await response(scope, receive, send)
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)
