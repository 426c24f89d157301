"""Nothing is lost under load: the real server in a subprocess, real clients.

- A flood past ``--max-queue`` is shed with 429 + Retry-After, and every request the server
  accepted finishes with exactly the greedy oracle's tokens; clients that honour
  Retry-After get every request served in the end, and the metrics count each answer once.
- Backpressure is per stream: a client that stops reading its SSE stream (a small receive
  window and no reads) stalls only its own handler. The server has produced more bytes for
  it than the kernel's socket buffers can hold, so that handler really waits on the client,
  while other streams start and finish in bounded time. The slow client then reads
  everything, intact; or it disconnects and its slot is freed.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import httpx
import pytest

from graphburst import greedy_reference
from test_http_server import ServerProcess, metric_values, sse_events

pytest.importorskip("aiohttp")

# ---------------------------------------------------------------------- flood and 429

FLOOD_VOCAB = 5003


def test_a_flood_is_shed_with_429_and_every_accepted_request_completes():
    s = ServerProcess("--batch", "2", "--max-queue", "2", "-k", "3", "-m", "4", "--vocab", str(FLOOD_VOCAB),
                      "--capacity", "512")
    prompts = [[i + 1, 7, i % 5] for i in range(16)]
    n = 32
    first: dict = {}  # request -> the status of its first try
    refused = [0]  # 429s over all tries

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": n, "stream": i % 2 == 0}
        deadline = time.monotonic() + 90
        while True:
            r = await client.post("/v1/completions", json=body)
            first.setdefault(i, r.status_code)
            if r.status_code != 429:
                break
            refused[0] += 1
            assert int(r.headers["Retry-After"]) >= 1 and "max-queue" in r.json()["error"]["message"]
            assert time.monotonic() < deadline, "a request was refused for 90 s"
            await asyncio.sleep(int(r.headers["Retry-After"]))
        assert r.status_code == 200, r.text
        if body["stream"]:
            events = sse_events(r.text.splitlines())
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
        return r.json()["choices"][0]["token_ids"]

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    try:
        before = metric_values(httpx.get(s.url + "/metrics", timeout=10).text)
        results = asyncio.run(main())
        after = metric_values(httpx.get(s.url + "/metrics", timeout=10).text)
    finally:
        assert s.terminate() == 0, s.errors()
    for i, tokens in enumerate(results):
        assert tokens == greedy_reference(prompts[i], n, FLOOD_VOCAB), i
    codes = list(first.values())
    assert codes.count(429) >= len(prompts) // 4 and 200 in codes, codes  # 16 at once into 2 slots + 2 waiting

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Every request finished once, none cancelled or failed; every 429 was counted.
    assert delta("graphburst_requests_total", finish_reason="length") == len(prompts)
    for reason in ("cancelled", "error"):
        assert delta("graphburst_requests_total", finish_reason=reason) == 0
    assert delta("graphburst_http_rejected_total", code="429") == refused[0] >= codes.count(429)
    assert delta("graphburst_generation_tokens_total") == n * len(prompts)


# ---------------------------------------------------------------------- per-stream backpressure

VOCAB = 64
WORD_CHARS = 16_000  # each token's text: a stream's SSE bytes grow fast, so a client that stops reading blocks it
SLOW_RCVBUF = 4096  # the slow client's socket receive buffer (the kernel doubles it)
OTHERS = 3


def _kernel_send_buffer_max() -> int:
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 * 2**20  # Linux's default


# More than the server's socket send buffer can ever hold, plus aiohttp's and asyncio's 64 KiB
# write buffers and the slow client's receive buffer: past this many bytes the server's
# handler for that stream must be waiting for the client.
STALL_BYTES = _kernel_send_buffer_max() + 2**20
STALL_TOKENS = STALL_BYTES // WORD_CHARS + 1


@pytest.fixture(scope="module")
def long_words(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("long_words")
    tok = Tokenizer(models.WordLevel({f"w{i}" + "x" * WORD_CHARS: i for i in range(VOCAB)}, unk_token="w0"
                                     + "x" * WORD_CHARS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def bp_server(long_words):
    s = ServerProcess("--batch", str(OTHERS + 1), "-k", "3", "-m", "4", "--vocab", str(VOCAB), "--capacity", "65536",
                      "--tokenizer", str(long_words))
    yield s
    assert s.terminate() == 0, s.errors()


def _metric(url, name, **labels) -> float:
    return metric_values(httpx.get(url + "/metrics", timeout=10).text).get((name, tuple(sorted(labels.items()))),
                                                                           0.0)


def _open_slow_stream(url: str, prompt, n) -> http.client.HTTPConnection:
    """A streaming request on a socket with a tiny receive window; nothing is read from it."""
    host, port = url.split("//")[1].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)  # before connect: the window stays small
    sock.settimeout(60)
    sock.connect((host, int(port)))
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.sock = sock
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": n, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn


def _wait_until_stalled(url: str, tokens_before: float) -> None:
    """Until the server has generated STALL_TOKENS tokens for the slow stream (its bytes overflow every buffer)."""
    deadline = time.monotonic() + 60
    while _metric(url, "graphburst_generation_tokens_total") - tokens_before < STALL_TOKENS:
        assert time.monotonic() < deadline, "the slow stream did not get its tokens generated"
        time.sleep(0.05)


def _others_finish(url: str, timeout: float) -> float:
    """OTHERS streams started now; each must finish, with the oracle's tokens, within ``timeout`` s."""
    prompts = [[3 + i, 9] for i in range(OTHERS)]

    async def one(client, p):
        async with client.stream("POST", url + "/v1/completions",
                                 json={"prompt": p, "max_tokens": 40, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]

    async def main():
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout)

    t0 = time.perf_counter()
    got = asyncio.run(main())
    for p, tokens in zip(prompts, got):
        assert tokens == greedy_reference(p, 40, VOCAB)
    return time.perf_counter() - t0


def _wait_cancelled_and_freed(url: str, cancelled_before: float, timeout: float, why: str) -> None:
    """Until one more request has finished cancelled and no slot is active, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while _metric(url, "graphburst_requests_total", finish_reason="cancelled") - cancelled_before < 1 or \
            _metric(url, "graphburst_active_slots") != 0:
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def test_a_client_that_stops_reading_stalls_only_its_own_stream(bp_server):
    url = bp_server.url
    n = 2 * STALL_TOKENS
    before = _metric(url, "graphburst_generation_tokens_total")
    slow = _open_slow_stream(url, [1, 2], n)
    _wait_until_stalled(url, before)
    took = _others_finish(url, timeout=30)
    print(f"{OTHERS} streams finished in {took:.2f} s beside a stalled one")
    # The slow client reads again: every event is there, in order, with the oracle's tokens.
    resp = slow.getresponse()
    assert resp.status == 200
    body = resp.read().decode()
    slow.close()
    assert len(body) > STALL_BYTES  # more than the kernel could have buffered: the server held the rest
    events = sse_events(body.splitlines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [t for c in chunks for t in c["token_ids"]] == greedy_reference([1, 2], n, VOCAB)
    assert chunks[-1]["finish_reason"] == "length"


def _stall_a_stream(url: str):
    """A long streaming request whose client reads nothing, once the server is blocked writing to
    it: ``(its connection, the cancelled-requests count before it)``."""
    cancelled = _metric(url, "graphburst_requests_total", finish_reason="cancelled")
    before = _metric(url, "graphburst_generation_tokens_total")
    slow = _open_slow_stream(url, [5, 6], 60_000)  # at the numpy backend's pace this outlasts the test
    _wait_until_stalled(url, before)
    return slow, cancelled


def test_a_stalled_client_that_disconnects_frees_its_slot(bp_server):
    url = bp_server.url
    slow, cancelled = _stall_a_stream(url)
    _others_finish(url, timeout=30)
    slow.sock.close()  # unread data: the kernel resets the connection
    _wait_cancelled_and_freed(url, cancelled, 10, "the stalled stream's request was not cancelled")
    # Every slot serves again
    _others_finish(url, timeout=30)


@pytest.fixture(scope="module")
def timeout_server(long_words):
    s = ServerProcess("--batch", str(OTHERS + 1), "-k", "3", "-m", "4", "--vocab", str(VOCAB), "--capacity", "65536",
                      "--tokenizer", str(long_words), "--write-timeout", "1")
    yield s
    assert s.terminate() == 0, s.errors()


def test_a_client_that_neither_reads_nor_leaves_is_cut_off_after_the_write_timeout(timeout_server):
    url = timeout_server.url
    slow, cancelled = _stall_a_stream(url)
    # the client keeps its socket open and reads nothing
    _wait_cancelled_and_freed(url, cancelled, 15, "the stalled stream was not cut off after --write-timeout")
    # The server closed the connection: the client reads what the kernel held, then the end
    # (a socket.timeout here would mean the connection is still open).
    _read_until_closed(slow.sock)
    _others_finish(url, timeout=30)  # every slot serves again


def _read_until_closed(sock) -> None:
    sock.settimeout(10)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass  # abort() resets the connection: the unread data is dropped
    finally:
        sock.close()
