"""What an HTTP server needs on a network: API keys, TLS, request ids, an access log and CORS.

:func:`options` turns a :class:`~graphburst.serving.factory.ServeConfig` (and the
``GRAPHBURST_API_KEY`` environment variable) into :class:`NetworkOptions`, or a ValueError of
one line naming the flag or file; :func:`middlewares` and :func:`on_response_prepare` put
them on an aiohttp application (:class:`graphburst.serving.http.Server`).

* **Keys** are kept as SHA-256 digests only, and a presented key is compared with every one
  of them by :func:`hmac.compare_digest` (no early exit), so neither the time of a check nor
  a length difference tells which key, or how much of one, matched. A key is never written
  anywhere: not in an error, a log line, ``/metrics`` or a config's ``repr``.
* **Request ids**: a client's ``X-Request-Id`` of 1 to 128 printable ASCII characters without
  spaces is taken as it is; anything else (or none) gets a made-up one (uuid4 hex). The id is
  echoed in every response's ``X-Request-Id`` and ends the completion's ``id``.
* **Access log**: one JSON line per request, after its answer (a stream: after its last chunk);
  no prompt text, no header values.
* **CORS** is written here rather than taken from ``aiohttp_cors``: the server needs only
  "these origins, every route, no credentials", about 30 lines, while ``aiohttp_cors`` wants
  every route registered with it and a dependency in the ``serve`` extra.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import ssl
import sys
import time
import uuid

from aiohttp import web

from . import openai_api as api

KEY_ENV = "GRAPHBURST_API_KEY"
MAX_REQUEST_ID = 128
CLIENT_CLOSED = 499  # the access log's status of a request whose client went away (nginx's convention)
AUTH_REASONS = ("missing", "malformed", "wrong")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, X-Request-Id"
CORS_MAX_AGE_S = 600


class AuthError(api.APIError):
    """A 401 in the OpenAI shape, ``code: "invalid_api_key"`` as OpenAI and vLLM answer."""

    def __init__(self, message: str):
        super().__init__(message, status=401)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": "invalid_api_key"}}


AUTH_MESSAGES = {
    "missing": "no API key: send the header 'Authorization: Bearer KEY'",
    "malformed": "the Authorization header is not 'Bearer KEY'",
    "wrong": "the API key is not valid",
}


@dataclasses.dataclass(frozen=True)
class NetworkOptions:
    """The network settings of one server. ``key_digests``: SHA-256 of each key (empty: no keys)."""

    key_digests: tuple = ()
    metrics_need_key: bool = False
    allowed_origins: frozenset = frozenset()
    access_log: object = None  # a text stream, or None: no access log
    ssl: ssl.SSLContext | None = None

    @property
    def keyed(self) -> bool:
        return bool(self.key_digests)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _check_key(key: str, where: str) -> str:
    """A key as sent after ``Bearer ``: printable ASCII, no spaces (the key itself is never quoted)."""
    if not key:
        raise ValueError(f"{where}: an API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces (it is sent as "
                         f"'Authorization: Bearer KEY')")
    return key


def load_keys(flags, key_file: str | None, environ=os.environ) -> list[str]:
    """Every configured key: ``--api-key`` (repeatable), ``--api-key-file`` (one a line; blank lines
    and ``#`` comments skipped), ``GRAPHBURST_API_KEY``. ValueError names the flag, file and line."""
    keys = [_check_key(k, "--api-key") for k in flags or ()]
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--api-key-file {key_file}: cannot read it: {why}") from None
        found = 0
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(_check_key(line, f"--api-key-file {key_file} line {n}"))
                found += 1
        if not found:
            raise ValueError(f"--api-key-file {key_file}: holds no key (one a line; blank lines and # comments "
                             f"are skipped)")
    env = environ.get(KEY_ENV)
    if env is not None and env.strip():
        keys.append(_check_key(env.strip(), KEY_ENV))
    return keys


def _no_password():
    raise ValueError("is encrypted; give a key file without a passphrase")


def ssl_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The server's TLS context, or None without either file; ValueError of one line naming the file."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else ("--ssl-keyfile", "--ssl-certfile")
        raise ValueError(f"{given} {certfile or keyfile} needs {missing} too")
    for flag, path, marker in (("--ssl-certfile", certfile, "CERTIFICATE-----"),
                               ("--ssl-keyfile", keyfile, "PRIVATE KEY-----")):
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None
        if marker not in text:
            what = "a PEM certificate" if flag == "--ssl-certfile" else "a PEM private key"
            raise ValueError(f"{flag} {path}: is not {what} (no '-----BEGIN ...{marker}' line)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(certfile, keyfile, password=_no_password)
    except ValueError as exc:
        raise ValueError(f"--ssl-keyfile {keyfile}: {exc}") from None
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ValueError(f"--ssl-keyfile {keyfile}: is not the private key of --ssl-certfile {certfile}") from None
        if "CERT" in reason.upper():
            raise ValueError(f"--ssl-certfile {certfile}: cannot load the certificate: {reason}") from None
        raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load the pair: "
                         f"{reason}") from None
    return ctx


def check(config, environ=os.environ) -> None:
    """Every network flag of ``config`` checked as :func:`options` checks it, without opening the
    access log: the command line runs it before anything starts (``--tp`` ranks load their models
    before the server's own code runs). ValueError of one line naming the flag or file."""
    keys = load_keys(config.api_key, config.api_key_file, environ)
    if config.metrics_need_key and not keys:
        raise ValueError(f"--metrics-need-key: needs an API key (--api-key, --api-key-file or {KEY_ENV})")
    ssl_context(config.ssl_certfile, config.ssl_keyfile)
    for origin in config.allowed_origins or ():
        _check_origin(origin)
    path = config.access_log
    if not config.no_access_log and path not in (None, "-"):
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(path if os.path.exists(path)
                                                                              else folder, os.W_OK):
            raise ValueError(f"--access-log {path}: cannot open it for appending")


def options(config, environ=os.environ, stderr=None) -> NetworkOptions:
    """The :class:`NetworkOptions` of ``config`` (ValueError of one line naming the flag or file)."""
    keys = load_keys(config.api_key, config.api_key_file, environ)
    if config.metrics_need_key and not keys:
        raise ValueError(f"--metrics-need-key: needs an API key (--api-key, --api-key-file or {KEY_ENV})")
    context = ssl_context(config.ssl_certfile, config.ssl_keyfile)
    origins = frozenset(_check_origin(o) for o in config.allowed_origins or ())
    log = None
    if not config.no_access_log:
        if config.access_log in (None, "-"):
            log = sys.stderr if stderr is None else stderr
        else:
            try:
                log = open(config.access_log, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the server's life
            except OSError as exc:
                raise ValueError(f"--access-log {config.access_log}: cannot open it: {exc.strerror or exc}") from None
    return NetworkOptions(key_digests=tuple(_digest(k) for k in keys), metrics_need_key=config.metrics_need_key,
                          allowed_origins=origins, access_log=log, ssl=context)


def _check_origin(origin: str) -> str:
    if origin == "*" or ("://" in origin and not origin.endswith("/")):
        return origin
    raise ValueError(f"--allowed-origins {origin!r}: an origin is SCHEME://HOST[:PORT] with no path "
                     f"(e.g. https://app.example.com), or *")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure_warning(host: str, opts: NetworkOptions) -> str | None:
    """The start-up warning of a server that anyone on the network can use, or None."""
    if opts.keyed or is_loopback(host):
        return None
    return (f"warning: listening on {host} with no API key: anyone who can reach this port can use the server "
            f"(give --api-key, --api-key-file or {KEY_ENV})")


def request_id(sent: str | None) -> str:
    """The client's ``X-Request-Id`` when it is 1..128 printable ASCII characters without spaces, else a new one."""
    if sent and len(sent) <= MAX_REQUEST_ID and all("!" <= c <= "~" for c in sent):
        return sent
    return uuid.uuid4().hex


def auth_failure(header: str | None, digests: tuple) -> str | None:
    """None when ``header`` is ``Bearer KEY`` with a configured key, else the reason (AUTH_REASONS)."""
    if header is None or not header.strip():
        return "missing"
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "malformed"
    given = _digest(token)
    ok = False
    for d in digests:  # every key, always: no early exit
        ok |= hmac.compare_digest(given, d)
    return None if ok else "wrong"


def _needs_key(request: web.Request, opts: NetworkOptions) -> bool:
    path = request.path
    return path == "/v1" or path.startswith("/v1/") or (opts.metrics_need_key and path == "/metrics")


def _route(request: web.Request) -> str:
    """The route's path as registered (or, unmatched, the path sent, cut to 200 characters)."""
    resource = getattr(request.match_info.route, "resource", None)
    return resource.canonical if resource is not None else request.path[:200]


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def middlewares(opts: NetworkOptions, metrics, error) -> list:
    """The middlewares, outermost first: request id and access log, CORS preflights, API keys.

    ``error(exc, headers)``: the server's own error response (counted in ``graphburst_http_rejected``).
    """

    @web.middleware
    async def access(request: web.Request, handler) -> web.StreamResponse:
        request["request_id"] = request_id(request.headers.get("X-Request-Id"))
        request["log"] = log = {}
        start = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # the client went away; aiohttp cancelled the handler
            status = CLIENT_CLOSED
            raise
        finally:
            if opts.access_log is not None:
                _write_access(opts.access_log, request, status, log, start)

    @web.middleware
    async def cors(request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (request.method == "OPTIONS" and origin is not None and "Access-Control-Request-Method" in request.headers
                and _origin_allowed(origin, opts)):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", CORS_HEADERS),
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S), "Vary": "Origin"})
        return await handler(request)

    @web.middleware
    async def keys(request: web.Request, handler) -> web.StreamResponse:
        if opts.keyed and _needs_key(request, opts):
            reason = auth_failure(request.headers.get("Authorization"), opts.key_digests)
            if reason is not None:
                metrics.auth_rejected.labels(reason).inc()
                resp = error(AuthError(AUTH_MESSAGES[reason]), {"WWW-Authenticate": "Bearer"})
                if request.can_read_body:  # the body was never read: do not reuse the connection
                    resp.force_close()
                return resp
        return await handler(request)

    return [access, cors, keys]


def _origin_allowed(origin: str, opts: NetworkOptions) -> bool:
    return origin in opts.allowed_origins or "*" in opts.allowed_origins


def on_response_prepare(opts: NetworkOptions):
    """The ``on_response_prepare`` signal handler: ``X-Request-Id`` and CORS headers on every response,
    streams included (their headers go out before the handler returns)."""

    async def prepare(request: web.Request, resp: web.StreamResponse) -> None:
        rid = request.get("request_id")
        if rid is not None:
            resp.headers["X-Request-Id"] = rid
        origin = request.headers.get("Origin")
        if origin is not None and _origin_allowed(origin, opts):
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
            resp.headers.setdefault("Vary", "Origin")

    return prepare


def _write_access(stream, request: web.Request, status: int, log: dict, start: float) -> None:
    """One JSON line: no prompt text, no header but the request id."""
    def ms(key: str) -> float | None:
        value = log.get(key)
        return None if value is None else round(value * 1e3, 3)

    record = {"time": _utc_now(), "request_id": request["request_id"], "client": request.remote,
              "method": request.method, "route": _route(request), "status": status,
              "prompt_tokens": log.get("prompt_tokens"), "completion_tokens": log.get("completion_tokens"),
              # time to first token, and its parts: the wait for a slot, the prefill up to the first
              # token on the host, the hand-out from the engine thread to this request's handler
              "ttft_ms": ms("ttft_s"), "queue_ms": ms("queue_s"), "prefill_ms": ms("prefill_s"),
              "emit_ms": ms("emit_s"),
              "duration_ms": round((time.perf_counter() - start) * 1e3, 3),
              "finish_reasons": log.get("finish_reasons")}
    try:
        stream.write(json.dumps(record, separators=(",", ":")) + "\n")
        stream.flush()
    except (OSError, ValueError):  # a full disk or a closed stream costs the log line, never the request
        pass
