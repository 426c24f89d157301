"""``graphburst bench serve --http``: the HTTP server under real concurrent clients.

The server is ``graphburst serve --http 127.0.0.1:0`` in a subprocess (ephemeral port,
loopback only); this process is the load generator: N concurrent ``httpx`` streaming
clients, one completion each, bounded in count and in time. A checked warm-up request
comes first; every timed stream must end with ``[DONE]`` and carry exactly the greedy
reference tokens. Inter-token latency is measured at the client, from SSE chunk arrival
times; the GPU idle fraction comes from the server's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..kernels.digest import greedy_reference
from ..serving.timing import percentiles
from .common import VOCAB

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # so the subprocess imports this graphburst
START_TIMEOUT_S = 120.0  # cupy import, kernel warm-up and capture on a cold GPU machine
STOP_TIMEOUT_S = 30.0


class Server:
    """``python -m ARGV`` in a subprocess that prints ``graphburst serve: listening on http://...``; ``url``
    once it listens.

    ``argv`` defaults to ``graphburst serve --http 127.0.0.1:0 FLAGS``. The lines the child
    prints to stdout before that one are kept in ``preamble``; its stderr goes to a file,
    whose tail the error names when the child does not come up within ``start_timeout`` s.
    """

    def __init__(self, flags: list[str], *, argv: list[str] | None = None, start_timeout: float = START_TIMEOUT_S):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        argv = ["graphburst.cli", "serve", "--http", "127.0.0.1:0", *flags] if argv is None else argv
        cmd = [sys.executable, "-m", *argv]
        # stderr to a file: a pipe nobody reads during the run would fill and stall the server
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        self.preamble: list[str] = []
        line = self._read_until_listening(start_timeout)
        if line is None:
            self.stop()
            self.stderr.seek(0)
            tail = self.stderr.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"the server did not start ({' '.join(cmd)[:300]}): {tail}")
        self.url = line.rsplit(" ", 1)[1]

    def _read_until_listening(self, timeout: float) -> str | None:
        """The listening line, or None when the child exits or the time is up first."""
        fd, buf = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0 and sel.select(left):
                data = os.read(fd, 65536)
                if not data:
                    return None
                buf += data
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    line = raw.decode(errors="replace").strip()
                    if line.startswith("graphburst serve: listening on http://"):
                        return line
                    self.preamble.append(line)
        return None

    def stop(self) -> int:
        """SIGTERM, then kill if it has not exited within STOP_TIMEOUT_S."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


async def _stream_one(client, url: str, prompt: list, max_tokens: int) -> dict:
    """One streaming completion: its tokens and ``(arrival time, n_tokens)`` per chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    tokens, chunks, done = [], [], False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            ids = json.loads(data)["choices"][0].get("token_ids") or []
            if ids:
                chunks.append((time.perf_counter(), len(ids)))
                tokens += ids
    if not done:
        raise RuntimeError("a stream ended without data: [DONE]")
    return {"start": t0, "tokens": tokens, "chunks": chunks}


async def _drive(url: str, prompts: list, max_tokens: int, timeout_s: float) -> tuple[list, float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        warm = await _stream_one(client, url, [1, 2, 3], max_tokens)  # checked warm-up, not timed
        if warm["tokens"] != greedy_reference([1, 2, 3], max_tokens, VOCAB):
            raise AssertionError("HTTP warm-up: tokens differ from the greedy reference")
        t0 = time.perf_counter()
        runs = await asyncio.wait_for(asyncio.gather(*(_stream_one(client, url, p, max_tokens) for p in prompts)),
                                      timeout_s)
        return runs, time.perf_counter() - t0


def scrape(url: str) -> dict:
    """The server's /metrics samples without labels, by name."""
    import httpx

    return scrape_text(httpx.get(f"{url}/metrics", timeout=10).text)


def scrape_text(text: str) -> dict:
    """Prometheus text -> {sample name: value}; a labelled sample under ``name{label="value",...}``
    (labels sorted), as the text format writes it."""
    from prometheus_client.parser import text_string_to_metric_families

    def key(s) -> str:
        if not s.labels:
            return s.name
        return s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}"

    return {key(s): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def run_http(backend_name: str, *, pipelined: bool, cost_us: float, clients: int, new_tokens: int,
             timeout_s: float, batch=64, k=4, m=8) -> dict:
    """One server, ``clients`` concurrent streaming requests; the row of the HTTP table."""
    flags = ["--backend", backend_name, "--batch", str(batch), "-k", str(k), "-m", str(m), "--vocab", str(VOCAB),
             "--capacity", str(64 + new_tokens + m * (k + 1)), "--cost-us", str(cost_us),
             "--max-queue", str(max(clients, 1)), "--drain-timeout", "5"]
    if not pipelined:
        flags.append("--no-pipeline")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, 16).tolist() for _ in range(clients)]
    server = Server(flags)
    try:
        runs, wall = asyncio.run(_drive(server.url, prompts, new_tokens, timeout_s))
        metrics = scrape(server.url)
    finally:
        rc = server.stop()
    if rc != 0:
        raise RuntimeError(f"the server exited with {rc} after SIGTERM")
    for i, (p, r) in enumerate(zip(prompts, runs)):
        if r["tokens"] != greedy_reference(p, new_tokens, VOCAB):
            raise AssertionError(f"HTTP client {i}: tokens differ from the greedy reference")
    itl, gaps, ttft = [], [], []
    for r in runs:
        (t_first, _), rest = r["chunks"][0], r["chunks"][1:]
        ttft.append((t_first - r["start"]) * 1e3)
        t_prev = t_first
        for t, n in rest:
            gaps.append((t - t_prev) * 1e6)
            itl += [(t - t_prev) * 1e6 / n] * n
            t_prev = t
    idle = metrics.get("graphburst_gpu_idle_fraction")
    steady = metrics.get("graphburst_gpu_idle_fraction_steady")
    tokens = sum(len(r["tokens"]) for r in runs)
    return dict(engine="graph pipelined" if pipelined else "graph", transport="http", workload="burst", cost_us=cost_us,
                clients=clients, requests=clients, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                itl_amortised_us=percentiles(itl), delivery_gap_us=percentiles(gaps), ttft_ms=percentiles(ttft),
                gpu_idle_fraction=None if idle is None or idle != idle else idle,
                gpu_idle_fraction_steady=None if steady is None or steady != steady else steady,
                steady_bursts=int(metrics.get("graphburst_steady_bursts_total", 0)),
                bursts=int(metrics.get("graphburst_bursts_total", 0)))
