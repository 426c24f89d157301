"""The open-loop clients: one asyncio task per request, started on the schedule's clock
whatever the server has finished (open loop), each one streaming completion over httpx.

A request sends its prompt as token ids with ``max_tokens`` = its drawn output length and
no ``stop_token_ids``: the server then stops a request only at ``max_tokens`` (it applies
no end-of-sequence token of its own), so every request must end with ``finish_reason``
``"length"`` and exactly ``max_tokens`` tokens, or it counts as an error. The connection
pool is unbounded, so no request waits in the client for a connection.
"""

from __future__ import annotations

import asyncio
import json
import time

from .load_schedule import Arrival
from .load_stats import LENGTH_FINISH, Record

DATA = "data: "
DONE = "[DONE]"


async def stream_one(client, url: str, arrival: Arrival, rec: Record) -> None:
    """POST one streaming completion; fill ``rec`` (never raises for an HTTP or stream failure)."""
    import httpx

    body = {"prompt": arrival.prompt, "max_tokens": arrival.max_tokens, "stream": True}
    rec.sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            rec.status = resp.status_code
            rec.request_id = resp.headers.get("X-Request-Id")
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith(DATA):
                    continue
                data = line[len(DATA):]
                if data == DONE:
                    rec.done = time.perf_counter()
                    break
                obj = json.loads(data)
                if "error" in obj:  # the server's in-stream error event
                    rec.error = f"stream error: {obj['error'].get('message')}"
                    continue
                choice = obj["choices"][0]
                ids = choice.get("token_ids") or []
                if ids:
                    rec.chunks.append((time.perf_counter(), len(ids)))
                    rec.tokens += ids
                rec.finish = choice.get("finish_reason") or rec.finish
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        rec.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return
    if rec.error is None:
        rec.error = _incomplete(rec)


def _incomplete(rec: Record) -> str | None:
    """Why a stream that ended without an error event is not a whole answer (None: it is)."""
    if rec.done is None:
        return "the stream ended without data: [DONE]"
    if rec.finish != LENGTH_FINISH or len(rec.tokens) != rec.max_tokens:
        return f"finished {rec.finish!r} after {len(rec.tokens)} of {rec.max_tokens} tokens"
    return None


def client(timeout_s: float):
    """An httpx client with no connection limit (open loop) and ``timeout_s`` per read."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


async def run_open_loop(url: str, arrivals: list[Arrival], *, deadline_s: float) -> tuple[list[Record], float, float]:
    """Send every arrival at its time; wait for all, at most ``deadline_s`` after the start.

    Returns
    -------
    (records, wall, lag)
        One :class:`Record` per arrival, in order; ``wall``: seconds from the start to the
        last request's end; ``lag``: the latest any request was sent after its time (the
        client's own delay, which should stay near 0).
    """
    records = [Record(a.t, len(a.prompt), a.max_tokens) for a in arrivals]
    async with client(deadline_s) as http:
        t0 = time.perf_counter()
        tasks, lag = [], 0.0
        for a, rec in zip(arrivals, records):
            delay = t0 + a.t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = max(lag, time.perf_counter() - (t0 + a.t))
            tasks.append(asyncio.create_task(stream_one(http, url, a, rec)))
        left = max(deadline_s - (time.perf_counter() - t0), 0.0)
        _, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        wall = time.perf_counter() - t0
    for rec in records:
        if rec.error is None and rec.done is None:
            rec.error = f"no answer within the run's deadline ({deadline_s:g} s)"
    return records, wall, lag


async def run_requests(url: str, arrivals: list[Arrival], *, timeout_s: float) -> list[Record]:
    """Send ``arrivals`` all at once (their times ignored): the correctness check's requests."""
    records = [Record(0.0, len(a.prompt), a.max_tokens) for a in arrivals]
    async with client(timeout_s) as http:
        await asyncio.wait_for(asyncio.gather(*(stream_one(http, url, a, r) for a, r in zip(arrivals, records))),
                               timeout_s)
    return records
