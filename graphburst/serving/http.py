"""``graphburst serve --http [HOST:]PORT``: an OpenAI-compatible HTTP server over one ServeLoop.

aiohttp parses HTTP and runs the handlers on one asyncio event loop; the ServeLoop lives
on the engine thread (:mod:`graphburst.serving.engine_thread`), captured once at start-up. A
completion request is validated (:mod:`graphburst.serving.openai_api`; a chat request by
:mod:`graphburst.serving.chat`, which renders the model's chat template), turned into one
ticket per choice, and answered either as one JSON body or as server-sent events, one
``data:`` chunk per burst that delivered tokens, then a final chunk with ``finish_reason``
(and ``usage``), then ``data: [DONE]``.

Backpressure is per stream: the engine thread never waits for a client. Each request
buffers its own updates in an unbounded asyncio.Queue (bounded in practice by its
``max_tokens``), and only its own handler waits in ``resp.write`` while the client does not
read; the other handlers and the engine run on. A client that takes no chunk for
``--write-timeout`` seconds is cut off and its request cancelled.

A client that goes away is cancelled at the next burst boundary: aiohttp cancels the
handler when the connection drops (``handler_cancellation=True``), and a failed write does
the same, and either way the handler's ``finally`` cancels its tickets. SIGINT/SIGTERM stop
admissions (503), let requests in flight finish for ``--drain-timeout`` seconds, cancel the
rest, and exit 0.

API keys, TLS, request ids, the access log and CORS are :mod:`graphburst.serving.network`'s,
as middlewares around the handlers; its options are read and checked before any model loads.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid

from aiohttp import web

from . import chat as chat_api
from . import network
from . import openai_api as api
from ..backend import get_backend
from ..models.gguf_checkpoint import is_gguf
from ..models.llama_config import CheckpointError
from ..models.named import resolve_model
from ..models.tokenizer import checkpoint_tokenizer
from ..validate import parse_json
from .engine_thread import EngineThread, Ticket
from .metrics import CONTENT_TYPE, Metrics
from .factory import build_loop, model_name, resolve_capacity, startup_notes
from .request import Request
from .loop import ServeLoop
from .request import MAX_REQUEST_BYTES

DEFAULT_ADDRESS = "127.0.0.1:8000"
MAX_BODY_BYTES = MAX_REQUEST_BYTES  # aiohttp's client_max_size
RETRY_AFTER_S = 1
BODY_TIMEOUT_S = 30.0  # Server's default body timeout (serving: ServeConfig.body_timeout, --body-timeout)
WRITE_TIMEOUT_S = 300.0  # Server's default write timeout (ServeConfig.write_timeout, --write-timeout)
CANCEL_GRACE_S = 2.0  # after the drain timeout: time for cancelled handlers to send their last chunk
# The engine thread and the event loop share the GIL. When the engine's drain returns, it
# waits for the GIL until the event loop gives it up, at the latest after the switch
# interval (5 ms by default: 40 bursts at B=64). The pipelined loop has about one burst
# (~100 µs on an H200) of slack after a drain, so the server process uses a shorter interval.
GIL_SWITCH_INTERVAL_S = 1e-4


def parse_address(text: str) -> tuple[str, int]:
    """``"8000"``, ``"0.0.0.0:8000"`` or ``"[::1]:8000"`` -> (host, port); port 0 picks a free port."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else DEFAULT_ADDRESS.split(":")[0]
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--http {text!r}: expected [HOST:]PORT with PORT in 0..65535")
    return host, int(port)


def load_tokenizer(model_dir: str):
    """The ``tokenizers`` tokenizer in ``model_dir/tokenizer.json``, or the one a GGUF file (or named
    model) carries, as transformers builds it from the file's metadata."""
    from tokenizers import Tokenizer

    if is_gguf(resolve_model(model_dir)):
        try:
            return checkpoint_tokenizer(model_dir).backend_tokenizer
        except CheckpointError as exc:
            raise ValueError(f"--tokenizer {model_dir!r}: {exc}") from None
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {model_dir!r}: no tokenizer.json there")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        raise ValueError(f"--tokenizer {model_dir!r}: cannot load tokenizer.json: {exc}") from exc


class _Detokenizer:
    """Incremental text of one choice (``tokenizers.decoders.DecodeStream``); "" without a tokenizer."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def feed(self, tokens: list) -> str:
        if self.tokenizer is None:
            return ""
        parts = (self.stream.step(self.tokenizer, t) for t in tokens)
        return "".join(p for p in parts if p is not None)  # None: a UTF-8 sequence not complete yet


def _sse(obj) -> bytes:
    # Server-sent events framing is one line per event; aiohttp owns all HTTP framing.
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Server:
    """Routes and request lifecycle; runs on the event loop thread only."""

    def __init__(self, engine: EngineThread, metrics: Metrics, *, model: str, vocab: int, capacity: int,
                 max_queue: int, tokenizer=None, chat: chat_api.ChatTokenizer | None = None, sampling: bool = False,
                 fields: bool = False, body_timeout: float = BODY_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S,
                 net: network.NetworkOptions | None = None, k: int | None = None):
        self.engine, self.metrics = engine, metrics
        self.net = net or network.NetworkOptions()  # API keys, access log, CORS (serving/network.py)
        self.write_timeout = write_timeout
        self.chat = chat  # the transformers tokenizer with the chat template; None without --tokenizer
        self.body_timeout = body_timeout
        self.sampling = sampling
        self.fields = fields  # the loop applies the logits processing fields (--sampling --fields)
        self.k = k  # the loop's drafts per round, which num_speculative_tokens may lower; None: refused
        self.model, self.vocab, self.capacity = model, vocab, capacity
        self.max_queue, self.tokenizer = max_queue, tokenizer
        self.created = api.now()
        self.draining = False
        self.live = 0  # completion handlers running
        self.drained = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[*network.middlewares(self.net, self.metrics, self._error), self._json_errors])
        app.on_response_prepare.append(network.on_response_prepare(self.net))
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions), web.get("/v1/models", self.models),
                        web.get("/health", self.health), web.get("/metrics", self.metrics_text)])
        return app

    @web.middleware
    async def _json_errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error aiohttp raises around a handler (404, 405, 413, ...) as an OpenAI error body, counted
        in the rejection metric like the handlers' own; an unexpected exception is a JSON 500."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error(_http_error(request, exc), headers={k: v for k, v in exc.headers.items()
                                                                   if k.lower() == "allow"})
        except Exception as exc:  # noqa: BLE001 - a bug costs this request only, never the server
            if request.get("streaming"):  # the SSE head is out: no other response can follow it
                raise
            print(f"graphburst serve: {request.method} {request.path}: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            return self._error(api.APIError(f"internal error: {type(exc).__name__}", status=500,
                                            type="server_error"))

    async def _read_json(self, request: web.Request):
        """The body as JSON, read within --body-timeout (a half-sent body must not hold a handler forever)."""
        try:
            text = await asyncio.wait_for(request.text(), self.body_timeout)
        except asyncio.TimeoutError:
            raise api.APIError(f"the body was not received within {self.body_timeout:g} s (--body-timeout)",
                               status=408, param="body") from None
        except UnicodeDecodeError as exc:
            raise api.APIError(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}",
                               param="body") from None
        try:
            return parse_json(text)  # the server side ignores Content-Type (curl -d sends a form type)
        except ValueError as exc:
            raise api.APIError(f"the body is not valid JSON: {exc}", param="body") from None

    # ------------------------------------------------------------------ small routes

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(api.model_list(self.model, self.created, self.capacity))

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.failed:
            return web.json_response({"status": "engine failed", "error": self.engine.failed}, status=503)
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _error(self, exc: api.APIError, headers=None) -> web.Response:
        self.metrics.rejected.labels(str(exc.status)).inc()
        resp = web.json_response(exc.body(), status=exc.status, headers=headers)
        if exc.status in (408, 413):  # the rest of the body was never read: the connection cannot be reused
            resp.force_close()
        return resp

    # ------------------------------------------------------------------ completions

    def _on_update(self, ticket: Ticket, up, queue: asyncio.Queue, log: dict) -> None:
        """Every engine update passes here first, so metrics count even after a client left;
        ``log``: the request's access-log figures (serving/network.py)."""
        m = self.metrics
        if up.tokens:
            m.generation_tokens.inc(len(up.tokens))
            log["completion_tokens"] = log.get("completion_tokens", 0) + len(up.tokens)
            if ticket.last is None:
                m.ttft.observe(up.time - ticket.arrived)
                # set on the engine thread before this request's first tokens were published
                admitted = ticket.state.admitted if ticket.state is not None else None
                if admitted is not None:
                    m.queue_time.observe(admitted - ticket.arrived)
                    m.prefill_time.observe(up.time - admitted)
                if log.get("ttft_s") is None:
                    log["ttft_s"] = up.time - ticket.arrived
                    if admitted is not None:
                        log["queue_s"], log["prefill_s"] = admitted - ticket.arrived, up.time - admitted
                    # the hand-out on the engine thread to this handler on the event loop
                    log["emit_s"] = time.perf_counter() - up.time
            else:
                m.itl.observe((up.time - ticket.last) / len(up.tokens))
            ticket.last = up.time
        if up.reason is not None:
            ticket.final = up.reason
            m.finished(up.reason, up.accepted, up.rounds)
            if "finish_reasons" in log:
                log["finish_reasons"][ticket.index] = up.reason
        queue.put_nowait(up)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: api.parse_completion(
            body, model=self.model, vocab=self.vocab, capacity=self.capacity, tokenizer=self.tokenizer,
            max_prompts=self.max_queue, sampling=self.sampling, fields=self.fields, k=self.k), api.CompletionReply)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: chat_api.parse_chat(
            body, model=self.model, vocab=self.vocab, capacity=self.capacity, chat=self.chat,
            max_choices=self.max_queue, sampling=self.sampling, fields=self.fields, k=self.k), chat_api.ChatReply)

    async def _generate(self, request: web.Request, parse, reply_type) -> web.StreamResponse:
        """One generation request of either route: ``parse(body)`` validates it into an
        :class:`api.Completion`, ``reply_type`` shapes the answer (a body or SSE chunks)."""
        arrived = time.perf_counter()
        if self.draining or self.engine.failed:
            return self._error(api.APIError("the server is shutting down" if self.draining else
                                            f"the engine failed: {self.engine.failed}", status=503,
                                            type="service_unavailable"))
        try:
            body = await self._read_json(request)
            comp = parse(body)
        except api.APIError as exc:
            return self._error(exc)
        n = len(comp.prompts)
        if self.engine.waiting + n > self.max_queue:
            return self._error(api.APIError(f"{self.engine.waiting} requests are waiting (--max-queue "
                                            f"{self.max_queue}); retry later", status=429,
                                            type="rate_limit_error"), headers={"Retry-After": str(RETRY_AFTER_S)})
        rid = request.get("request_id") or uuid.uuid4().hex  # X-Request-Id (serving/network.py)
        cid = f"{reply_type.prefix}-{rid}"
        reply = reply_type(cid, api.now(), self.model, comp)
        queue: asyncio.Queue = asyncio.Queue()  # this request's updates: a stalled client stalls only its own
        stops = comp.stop_token_ids
        log = request.get("log", {})
        log.update(prompt_tokens=comp.prompt_tokens, completion_tokens=0, finish_reasons=[None] * n)
        # the loop's ids are unique in flight; a client's request id need not be
        uid = f"{reply_type.prefix}-{uuid.uuid4().hex}"
        tickets = [Ticket(Request(prompt=p, max_new_tokens=comp.max_tokens, eos=stops[0] if stops else None,
                                  id=f"{uid}-{i}", options=comp.options, **comp.choice_sampling(i)), i,
                          lambda t, u: self._on_update(t, u, queue, log), frozenset(stops[1:]), arrived=arrived)
                   for i, p in enumerate(comp.prompts)]
        if self.draining:  # SIGTERM arrived while the body was being read: refuse, never cut it off
            return self._error(api.APIError("the server is shutting down", status=503, type="service_unavailable"))
        self.metrics.prompt_tokens.inc(sum(map(len, comp.prompts)))
        self.live += 1
        self.engine.submit(tickets)
        try:
            if comp.stream:
                return await self._stream(request, comp, reply, queue)
            return await self._complete(comp, reply, queue)
        finally:  # normal end, failed write, or the handler cancelled because the client left
            left = [t for t in tickets if t.final is None]
            if left:
                self.engine.cancel(left)
            self.live -= 1
            if self.draining and self.live == 0:
                self.drained.set()

    async def _complete(self, comp: api.Completion, reply, queue: asyncio.Queue) -> web.Response:
        n = len(comp.prompts)
        tokens, texts, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        detok = [_Detokenizer(self.tokenizer, reply.skip_special_tokens) for _ in range(n)]
        errors = []
        while None in reasons:
            up = await queue.get()
            tokens[up.index] += up.tokens
            texts[up.index].append(detok[up.index].feed(up.tokens))
            reasons[up.index] = up.reason
            if up.error:
                errors.append(up.error)
        if errors:
            return self._error(api.APIError(f"generation failed: {errors[0]}", status=500, type="server_error"))
        use = api.usage(comp.prompt_tokens, sum(map(len, tokens)))
        return web.json_response(reply.body(["".join(t) for t in texts], tokens, reasons, use))

    async def _stream(self, request: web.Request, comp: api.Completion, reply,
                      queue: asyncio.Queue) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        request["streaming"] = True  # read by _json_errors
        n = len(comp.prompts)
        detok = [_Detokenizer(self.tokenizer, reply.skip_special_tokens) for _ in range(n)]
        left, generated = n, 0
        try:
            if head := reply.start():
                await self._send(resp, head)
            while left:
                up = await queue.get()  # one update per burst per choice
                generated += len(up.tokens)
                if up.reason is not None:
                    left -= 1
                elif not up.tokens:
                    continue
                if up.error:
                    await self._send(resp, _sse(api.APIError(up.error, status=500, type="server_error").body()))
                use = api.usage(comp.prompt_tokens, generated) if left == 0 else None
                await self._send(resp, reply.chunk(up.index, detok[up.index].feed(up.tokens), up.tokens, up.reason, use))
            if tail := reply.end(api.usage(comp.prompt_tokens, generated)):
                await self._send(resp, tail)
            await self._send(resp, b"data: [DONE]\n\n")
            await asyncio.wait_for(resp.write_eof(), self.write_timeout)
        except ConnectionError:  # the client went away mid-stream; finally in completions() cancels
            pass
        except TimeoutError:  # the client stopped reading: close the connection; completions() cancels
            if request.transport is not None:
                request.transport.abort()
        return resp

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        """One write, waiting at most ``write_timeout`` for the client to take it (TimeoutError):
        a client that neither reads nor disconnects must not hold its handler and slot forever."""
        await asyncio.wait_for(resp.write(data), self.write_timeout)


def _http_error(request: web.Request, exc: web.HTTPException) -> api.APIError:
    """aiohttp's own error (raised before or around a handler) as the APIError a client can read."""
    if exc.status == 404:
        routes = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
        return api.APIError(f"no route {request.method} {request.path}; this server has {routes}", status=404,
                            type="not_found_error")
    if exc.status == 405:
        return api.APIError(f"{request.method} is not allowed on {request.path}; use "
                            f"{exc.headers.get('Allow', 'another method')}", status=405)
    if exc.status == 413:
        return api.APIError(f"the body is over the {MAX_BODY_BYTES // 2**20} MiB limit", status=413, param="body")
    return api.APIError(exc.text or exc.reason, status=exc.status,
                        type="server_error" if exc.status >= 500 else "invalid_request_error")


async def _serve(args, loop: ServeLoop, host: str, port: int, tokenizer, chat,
                 net: network.NetworkOptions | None = None) -> int:
    net = net or network.NetworkOptions()
    aloop = asyncio.get_running_loop()
    engine = EngineThread(loop, aloop)
    metrics = Metrics(engine)
    server = Server(engine, metrics, model=model_name(args), vocab=loop.vocab, capacity=loop.dec.capacity,
                    max_queue=args.max_queue, tokenizer=tokenizer, chat=chat, sampling=loop.sampling,
                    fields=loop.fields, k=loop.dec.k if loop.dec.caps is not None else None,
                    body_timeout=args.body_timeout, write_timeout=args.write_timeout, net=net)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aloop.add_signal_handler(sig, stop.set)
    engine.start()
    # aiohttp's keep-alive timer runs from the connection's start until a whole request head has
    # arrived, and between requests: so it bounds an idle connection and a half-sent head alike.
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=CANCEL_GRACE_S,
                           keepalive_timeout=args.header_timeout,
                           # after an answer that left the body unread (408, 413), aiohttp reads on for this
                           # long before it closes: no longer than the body itself was given
                           lingering_time=args.body_timeout)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port, ssl_context=net.ssl).start()
        except OSError as exc:
            print(f"graphburst serve: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        bound_host, bound_port = runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        scheme = "https" if net.ssl is not None else "http"
        print(f"graphburst serve: listening on {scheme}://{shown}:{bound_port}", flush=True)
        await stop.wait()
        server.draining = True
        print(f"graphburst serve: draining {server.live} requests (up to {args.drain_timeout:g} s)",
              file=sys.stderr, flush=True)
        if server.live:
            try:
                await asyncio.wait_for(server.drained.wait(), args.drain_timeout)
            except asyncio.TimeoutError:
                engine.cancel_all()  # their handlers send a final "abort" chunk and return
                try:
                    await asyncio.wait_for(server.drained.wait(), CANCEL_GRACE_S)
                except asyncio.TimeoutError:
                    pass
    finally:
        await runner.cleanup()
        engine.stop()
        await asyncio.to_thread(engine.join, 10.0)
    s = engine.snapshot
    print(f"graphburst serve: stopped after {s['bursts']} bursts, {s['tokens']} tokens", file=sys.stderr)
    return 0


def _log_line(line: str) -> None:
    print(f"graphburst serve: {line}", file=sys.stderr, flush=True)


def run(args, console, loop: ServeLoop | None = None) -> int:
    """Entry point of ``graphburst serve --http``; CLI errors are one stderr line and exit 2.

    ``loop``: one built by the caller (rank 0 of ``--tp``: graphburst/parallel/lockstep.py).
    """
    try:
        host, port = parse_address(args.http)
        net = network.options(args)  # keys, TLS files, the access log: refused here, before any model loads
        if warning := network.exposure_warning(host, net):
            print(f"graphburst serve: {warning}", file=sys.stderr, flush=True)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        chat = chat_api.load_chat_tokenizer(args.tokenizer) if args.tokenizer else None
        if chat is not None and chat.missing:
            print(f"graphburst serve: /v1/chat/completions is off: {chat.missing}", file=sys.stderr)
        backend = get_backend(args.backend) if loop is None else loop.dec.backend
        if loop is None:
            args, plan = resolve_capacity(args, backend)  # --capacity auto: before anything is allocated
            if plan is not None:
                print(f"graphburst serve: {plan.describe()}", file=sys.stderr, flush=True)
            loop = build_loop(args, backend, log=_log_line)
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as exc:
        print(f"graphburst serve: {exc}", file=sys.stderr)
        return 2
    if not backend.is_gpu:
        print("graphburst serve: no GPU in use; running the numpy reference backend", file=sys.stderr)
    for line in startup_notes(args, loop, chat=chat is not None and not chat.missing and bool(chat.template)):
        _log_line(line)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # this process is the server: see GIL_SWITCH_INTERVAL_S
    return asyncio.run(_serve(args, loop, host, port, tokenizer, chat, net))
