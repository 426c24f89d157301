"""Two ``graphburst serve --http`` processes on one device at once, every token of every reply exact.

Each server is a subprocess on loopback (its port picked free: ``--http 127.0.0.1:0``) serving
the stub models with fewer batch slots than requests, so the requests queue and the slots refill
at burst boundaries as they finish (the budgets differ, and some stop early at a stop id). Both
servers get all their streaming requests at once; every reply is checked token for token
against the stub target's CPU greedy oracle (``greedy_reference``), and a failure names the
server, the request and its first wrong token. The cupy form (two servers sharing one GPU, 64
streams each) is marked gpu; the numpy form runs the same logic on a CPU with a few requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from marks import gpu
from test_http_server import ServerProcess

from graphburst import greedy_reference

pytest.importorskip("aiohttp")

SERVERS = ("A", "B")
# backend -> (requests per server, flags shared by both servers, each server's own flags).
FORMS = {
    "numpy": (16, ["--batch", "4", "-k", "3", "-m", "4", "--vocab", "5003", "--layers", "2", "--capacity", "128"],
              {"A": ["--accept", "0.7"], "B": ["--accept", "0.4"]}),
    "cupy": (64, ["--batch", "16", "-k", "4", "-m", "8", "--vocab", "32000", "--layers", "4", "--capacity", "512"],
             {"A": ["--accept", "0.7"], "B": ["--accept", "0.4", "--pipeline-depth", "3"]}),
}
MAX_TOKENS = {"numpy": (2, 48), "cupy": (8, 320)}  # each request's budget, drawn in this range
START_TIMEOUT_S = 180.0  # a GPU server's first start may compile kernels.cu
RUN_TIMEOUT_S = {"numpy": 240.0, "cupy": 60.0}


def make_requests(rng: np.random.Generator, count: int, vocab: int, budgets: tuple[int, int]) -> list[dict]:
    """``count`` bodies of /v1/completions, streamed: prompts of 1 to 16 tokens, budgets in ``budgets``, and
    every third one with a stop id its greedy reply reaches (so it ends early and frees its slot sooner)."""
    out = []
    for i in range(count):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 17))).tolist()
        n = int(rng.integers(budgets[0], budgets[1] + 1))
        body = {"prompt": prompt, "max_tokens": n, "stream": True}
        if i % 3 == 2:
            body["stop_token_ids"] = [greedy_reference(prompt, n, vocab)[int(rng.integers(0, n))]]
        out.append(body)
    return out


def expected(body: dict, vocab: int) -> tuple[list, str]:
    """The oracle's reply to ``body``: greedy tokens up to ``max_tokens``, cut after its stop id if it comes."""
    ref = greedy_reference(body["prompt"], body["max_tokens"], vocab)
    for stop in body.get("stop_token_ids", []):
        if stop in ref:
            return ref[:ref.index(stop) + 1], "stop"
    return ref, "length"


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list, str | None, bool]:
    """One streamed completion: its token ids, the finish reason of its last chunk, and whether [DONE] came."""
    tokens, reason, done = [], None, False
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise AssertionError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise AssertionError(f"error chunk: {chunk['error']}")
            choice = chunk["choices"][0]
            tokens += choice["token_ids"]
            reason = choice["finish_reason"] or reason
    return tokens, reason, done


async def run_all(urls: dict, bodies: dict, timeout: float) -> dict:
    """Every request of every server at once; server -> [result or exception] in request order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        tasks = {name: [stream_one(client, urls[name], b) for b in bodies[name]] for name in urls}
        flat = await asyncio.wait_for(asyncio.gather(*(t for name in urls for t in tasks[name]),
                                                     return_exceptions=True), timeout)
    out, i = {}, 0
    for name in urls:
        out[name], i = flat[i:i + len(bodies[name])], i + len(bodies[name])
    return out


def first_wrong(got: list, want: list) -> str:
    j = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    have = got[j] if j < len(got) else "nothing (the reply ended)"
    need = want[j] if j < len(want) else "nothing (the reply should have ended)"
    return f"first wrong token at index {j}: got {have}, want {need} ({len(got)} tokens, want {len(want)})"


def start_servers(backend: str, shared: list, own: dict) -> dict:
    """Both servers, started at once (a GPU server's start is mostly imports, compiles and captures)."""
    with ThreadPoolExecutor(len(own)) as pool:
        futures = {name: pool.submit(ServerProcess, *shared, *own[name], backend=backend,
                                     start_timeout=START_TIMEOUT_S) for name in own}
    servers, errors = {}, []
    for name, fut in futures.items():
        try:
            servers[name] = fut.result()
        except BaseException as exc:  # noqa: BLE001 - pytest.fail is an OutcomeException; stop the other one
            errors.append(f"server {name} did not start: {exc}")
    if errors:
        for s in servers.values():
            s.kill()
        pytest.fail("; ".join(errors))
    return servers


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cupy", marks=gpu)])
def test_two_servers_on_one_device_answer_every_stream_exactly(backend, rng):
    count, shared, own = FORMS[backend]
    vocab = int(shared[shared.index("--vocab") + 1])
    batch = int(shared[shared.index("--batch") + 1])
    assert count >= 3 * batch  # requests queue behind the slots, and each slot is refilled
    bodies = {name: make_requests(rng, count, vocab, MAX_TOKENS[backend]) for name in SERVERS}
    servers = start_servers(backend, shared, own)
    try:
        t0 = time.perf_counter()
        results = asyncio.run(run_all({name: s.url for name, s in servers.items()}, bodies, RUN_TIMEOUT_S[backend]))
        elapsed = time.perf_counter() - t0
        failures = []
        for name in SERVERS:
            for i, (body, res) in enumerate(zip(bodies[name], results[name])):
                where = f"server {name}, request {i} (prompt of {len(body['prompt'])}, max_tokens {body['max_tokens']}" \
                        f"{', stop ' + str(body['stop_token_ids']) if 'stop_token_ids' in body else ''})"
                if isinstance(res, BaseException):
                    failures.append(f"{where}: did not finish: {type(res).__name__}: {res}")
                    continue
                got, reason, done = res
                want, want_reason = expected(body, vocab)
                if got != want:
                    failures.append(f"{where}: {first_wrong(got, want)}")
                elif (reason, done) != (want_reason, True):
                    failures.append(f"{where}: finish_reason {reason!r} and [DONE] {done}, want {want_reason!r} and "
                                    "[DONE]")
        assert not failures, f"{len(failures)} of {2 * count} replies wrong:\n" + "\n".join(failures[:20])
        for name, s in servers.items():  # each server counted every request it finished
            text = httpx.get(s.url + "/metrics", timeout=10).text
            done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("graphburst_requests_total{"))
            assert done == count, f"server {name}: graphburst_requests_total {done}, want {count}"
        print(f"{backend}: 2 servers x {count} streams, {sum(len(r[0]) for rs in results.values() for r in rs)} "
              f"tokens in {elapsed:.2f} s")
    finally:
        codes = {name: s.terminate() for name, s in servers.items()}
    assert codes == dict.fromkeys(servers, 0), {name: (codes[name], s.errors()[-2000:]) for name, s in servers.items()}
