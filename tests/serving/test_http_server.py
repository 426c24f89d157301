"""The HTTP server as a user runs it: a subprocess on loopback, real clients (openai, httpx).

Every expected token sequence comes from the CPU greedy oracle, never from the server.
Stub sizes are small so the whole file runs in seconds on two cores (numpy backend).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from marks import requires_gpu
from graphburst import greedy_reference

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 5003
MODEL = "graphburst-stub"
START_TIMEOUT_S = 30.0
SMALL = ["--batch", "8", "-k", "3", "-m", "4", "--vocab", str(VOCAB), "--layers", "2", "--capacity", "512"]
LONG = 60_000  # tokens; at one token per round on numpy this outlasts every timeout below


class ServerProcess:
    """``graphburst serve --http HOST:0`` in a subprocess; the port comes from its stdout line, and
    ``url`` is ``http://`` (``https://`` with ``--ssl-certfile``) on loopback, where a server bound to
    0.0.0.0 is reached too. The caller's ``GRAPHBURST_API_KEY`` is left out of the server's
    environment (a key there would make every request need one); ``env`` may give it."""

    def __init__(self, *flags, backend="numpy", start_timeout=START_TIMEOUT_S, env=None, host="127.0.0.1"):
        self.start_timeout = start_timeout
        self.stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "graphburst.cli", "serve", "--http", f"{host}:0", "--backend", backend, *flags]
        env = {**{k: v for k, v in os.environ.items() if k != "GRAPHBURST_API_KEY"}, "PYTHONPATH": str(ROOT),
               **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True)
        line = self._first_line()
        scheme = "https" if "--ssl-certfile" in flags else "http"
        assert line.startswith(f"graphburst serve: listening on {scheme}://{host}:"), (line, self.errors())
        self.url = line.rsplit(" ", 1)[1].replace("0.0.0.0", "127.0.0.1")

    def _first_line(self) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=self.start_timeout):
            self.kill()
            pytest.fail(f"server did not start within {self.start_timeout} s: {self.errors()}")
        line = self.proc.stdout.readline().strip()
        if not line:
            pytest.fail(f"server exited: {self.errors()}")
        return line

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def terminate(self, timeout=15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def stop(self) -> None:
        """SIGTERM, and the server must exit 0."""
        code = self.terminate()
        assert code == 0, self.errors()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*SMALL)
    yield s
    assert s.terminate() == 0, s.errors()


def expected(prompt, n, stops=()):
    ref = greedy_reference(prompt, n, VOCAB)
    hits = [ref.index(t) for t in stops if t in ref]
    return ref[: min(hits) + 1] if hits else ref


def absent_token(ref) -> int:
    return next(t for t in range(VOCAB) if t not in ref)


def sse_events(lines) -> list:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def metric_values(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---------------------------------------------------------------------- openai client


def check_openai_client(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=30, max_retries=0)
    prompt = [17, 4000, 23, 5]
    ref = greedy_reference(prompt, 40, VOCAB)

    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
    assert done.choices[0].token_ids == ref
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 40)

    assert client.completions.create(model=MODEL, prompt=prompt).choices[0].token_ids == ref[:16]  # OpenAI default

    # First stop id -> device EOS; a later one -> checked on the host.
    for stops in ([ref[5]], [absent_token(ref), ref[7]]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, extra_body={"stop_token_ids": stops})
        assert r.choices[0].token_ids == expected(prompt, 40, stops), stops
        assert r.choices[0].finish_reason == "stop"

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].token_ids]
    assert streamed == ref
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and all(c.usage is None for c in chunks[:-1])

    two = client.completions.create(model=MODEL, prompt=[prompt, [9]], max_tokens=12)
    assert [c.token_ids for c in sorted(two.choices, key=lambda c: c.index)] == [ref[:12],
                                                                                greedy_reference([9], 12, VOCAB)]


def test_openai_client_matches_greedy_reference(server):
    check_openai_client(server.url)


def test_a_request_may_ask_for_fewer_drafts(server):
    """num_speculative_tokens, 0 (plain decoding) to the server's -k: the same greedy tokens, and at 0 no
    draft accepted in 24 rounds (the metrics' counters)."""
    prompt = [17, 4000, 23, 5]
    ref = greedy_reference(prompt, 24, VOCAB)
    counted = {}
    for k in (0, 2, 3):
        before = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": prompt, "max_tokens": 24, "num_speculative_tokens": k})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref, k
        after = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)
        counted[k] = [after[(name, ())] - before.get((name, ()), 0)
                      for name in ("graphburst_draft_accepted_total", "graphburst_spec_rounds_total")]
    assert counted[0] == [0, 24], counted
    assert counted[3][0] > counted[0][0] and counted[3][1] < 24, counted


def test_the_serving_docs_client_example_runs(server, capsys):
    """docs/serving.md's Python example, as written, against a running server (only its address differs)."""
    doc = (ROOT / "docs" / "serving.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in code
    exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/serving.md", "exec"), {})
    ref = greedy_reference([1, 2, 3], 16, VOCAB)
    want = ref[: ref.index(2) + 1] if 2 in ref else ref
    printed = capsys.readouterr().out
    assert printed.startswith(str(want)), (printed, want)


@pytest.mark.gpu
@requires_gpu
def test_openai_client_on_the_gpu_backend():
    s = ServerProcess(*SMALL, backend="cupy", start_timeout=180)  # first start compiles kernels.cu
    try:
        check_openai_client(s.url)
        idle = metric_values(httpx.get(s.url + "/metrics", timeout=10).text)[("graphburst_gpu_idle_fraction", ())]
        assert 0.0 <= idle <= 1.0, idle  # GPU timing events are live on this backend
    finally:
        assert s.terminate() == 0, s.errors()
        print(s.errors())  # the server's summary line, for the record (-s)


# ---------------------------------------------------------------------- load


async def _stream(client: httpx.AsyncClient, url: str, prompt, n) -> tuple[list, list]:
    body = {"prompt": prompt, "max_tokens": n, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events([line async for line in resp.aiter_lines()])
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    return tokens, events


def test_200_concurrent_streams_match_the_reference(server, rng):
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 10))).tolist() for _ in range(200)]
    limits = [int(rng.integers(1, 25)) for _ in prompts]

    async def main():
        limits_ = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits_) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(_stream(client, server.url, p, n) for p, n in zip(prompts, limits))), 120)

    t0 = time.perf_counter()
    results = asyncio.run(main())
    for (tokens, events), p, n in zip(results, prompts, limits):
        assert tokens == greedy_reference(p, n, VOCAB)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    print(f"200 streams in {time.perf_counter() - t0:.2f} s")


def test_disconnected_client_frees_its_slot():
    s = ServerProcess("--batch", "1", "-m", "8", "--vocab", str(VOCAB), "--capacity", "65536", "--accept", "0")
    try:
        with httpx.Client(base_url=s.url, timeout=20) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": LONG, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as resp:
                first = next(line for line in resp.iter_lines() if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["token_ids"]
            # Closed mid-stream. The single slot must be freed for this one to finish.
            r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 8})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_reference([5], 8, VOCAB)
            values = metric_values(client.get("/metrics").text)
        assert values[("graphburst_requests_total", (("finish_reason", "cancelled"),))] == 1
        assert values[("graphburst_requests_total", (("finish_reason", "length"),))] == 1
    finally:
        assert s.terminate() == 0, s.errors()


def test_overload_gets_429_with_retry_after():
    s = ServerProcess("--batch", "1", "--max-queue", "1", "-m", "8", "--vocab", str(VOCAB), "--accept", "0",
                      "--capacity", "4096")
    n = 1000

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": [i + 1], "max_tokens": n})
                                          for i in range(6)))

    try:
        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        for i, r in enumerate(responses):
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert "max-queue" in r.json()["error"]["message"]
            else:  # admitted requests are served in full
                assert r.json()["choices"][0]["token_ids"] == greedy_reference([i + 1], n, VOCAB)
    finally:
        assert s.terminate() == 0, s.errors()


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("body, param, named", [
    ({"max_tokens": 4}, "prompt", "prompt"),
    ({"prompt": [1, 99999]}, "prompt", "99999"),
    ({"prompt": [1, True]}, "prompt", "prompt[1]"),
    ({"prompt": []}, "prompt", "prompt"),
    ({"prompt": "hello"}, "prompt", "tokenizer"),
    ({"prompt": [1], "n": 0}, "n", "n=0"),
    ({"prompt": [[1], [2]], "n": 200}, "n", "max-queue"),
    ({"prompt": [1], "temperature": 0.7}, "temperature", "--sampling"),
    ({"prompt": [1], "top_k": 3}, "top_k", "--sampling"),
    ({"prompt": [1], "top_p": 0.5}, "top_p", "0.5"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens", "0"),
    ({"prompt": [1], "max_tokens": 100000}, "max_tokens", "100000"),
    ({"prompt": [1], "stop_token_ids": [VOCAB]}, "stop_token_ids", str(VOCAB)),
    ({"prompt": [1], "stream": "yes"}, "stream", "yes"),
    ({"prompt": [1], "num_speculative_tokens": 4}, "num_speculative_tokens", "[0, 3]"),  # the server runs -k 3
    ({"prompt": [1], "num_speculative_tokens": -1}, "num_speculative_tokens", "-1"),
    ({"prompt": [1], "num_speculative_tokens": 1.5}, "num_speculative_tokens", "1.5"),
    ("{not json", "body", "JSON"),
    ([1, 2, 3], "body", "object"),
])
def test_bad_bodies_get_400_naming_the_field(server, body, param, named):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err


# ---------------------------------------------------------------------- bodies the server cannot read


def test_bodies_json_cannot_take_get_a_400_naming_why(server):
    r = httpx.post(server.url + "/v1/completions", content="[" * 100_000, timeout=10)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", content='{"prompt": [1], "max_tokens": %s}' % ("9" * 5000),
                   timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and "max_tokens: an integer of 5000 digits, over the 4300-digit limit" in \
        err["message"] and "set_int_max_str_digits" not in err["message"], err


def test_errors_raised_around_the_handlers_are_openai_json_and_counted(server):
    before = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)
    got = {}
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    got[405] = r
    assert r.headers["Allow"] == "POST" and "use POST" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=10)
    got[404] = r
    assert "/v1/embeddings" in r.json()["error"]["message"] and "/v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b" " * (16 * 2**20 + 1), timeout=30)
    got[413] = r
    assert r.json()["error"]["param"] == "body" and "16 MiB" in r.json()["error"]["message"]
    for status, resp in got.items():
        assert resp.status_code == status and resp.headers["Content-Type"].startswith("application/json"), resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    after = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)
    for status in got:
        key = ("graphburst_http_rejected_total", (("code", str(status)),))
        assert after[key] - before.get(key, 0.0) == 1, status


def test_idle_and_half_sent_requests_are_cut_off_by_the_read_timeouts():
    import concurrent.futures
    import socket

    # Two different timeouts, so a swap of the two is seen: the head waits 1 s, the body 4 s.
    s = ServerProcess(*SMALL, "--header-timeout", "1", "--body-timeout", "4")
    try:
        host, port = s.url.split("//")[1].split(":")

        def connect():
            c = socket.create_connection((host, int(port)), timeout=10)
            return c

        def closed_after(c) -> float:  # seconds until the server closes (recv returns b"")
            t0 = time.monotonic()
            data = b""
            while chunk := c.recv(65536):
                data += chunk
            c.close()
            return time.monotonic() - t0, data

        # The three connections wait out their timeouts at once (the test lasts the longest one).
        idle, half_head, half_body = connect(), connect(), connect()
        half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waits = [pool.submit(closed_after, c) for c in (idle, half_head, half_body)]
            (idle_s, idle_data), (half_head_s, _), (elapsed, data) = [w.result() for w in waits]
        assert idle_data == b"" and idle_s < 3.5  # the header timeout, not the body's
        assert half_head_s < 8
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and 3.0 <= elapsed < 12, (elapsed, data)  # the body's 4 s
        assert b"--body-timeout" in body
        # A whole request on a fresh connection is still served.
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [4], "max_tokens": 3}, timeout=10)
        assert r.json()["choices"][0]["token_ids"] == greedy_reference([4], 3, VOCAB)
    finally:
        assert s.terminate() == 0, s.errors()


def test_good_requests_after_bad_ones_and_known_fields(server):
    r = httpx.post(server.url + "/v1/completions", timeout=10, json={
        "prompt": [3, 1], "max_tokens": 5, "temperature": 0, "user": "u", "whatever": 1, "model": MODEL})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_reference([3, 1], 5, VOCAB)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1], "model": "gpt-4"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_metrics_parse_as_prometheus_text(server):
    before = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)
    for n in (3, 9):
        assert httpx.post(server.url + "/v1/completions", json={"prompt": [2, 2], "max_tokens": n},
                          timeout=10).status_code == 200
    httpx.post(server.url + "/v1/completions", json={"prompt": [1], "suffix": "x"}, timeout=10)  # a 400
    after = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("graphburst_requests_total", finish_reason="length") == 2
    assert delta("graphburst_generation_tokens_total") == 12
    assert delta("graphburst_prompt_tokens_total") == 4
    assert delta("graphburst_time_to_first_token_seconds_count") == 2
    # TTFT's parts, one observation each per request; the parts' sums add up to TTFT's
    assert delta("graphburst_request_queue_time_seconds_count") == 2
    assert delta("graphburst_request_prefill_time_seconds_count") == 2
    assert delta("graphburst_request_queue_time_seconds_sum") + delta("graphburst_request_prefill_time_seconds_sum") \
        == pytest.approx(delta("graphburst_time_to_first_token_seconds_sum"), rel=1e-6, abs=1e-9)
    assert delta("graphburst_http_rejected_total", code="400") == 1
    assert delta("graphburst_spec_rounds_total") >= 2
    for name in ("graphburst_inter_token_latency_seconds_count", "graphburst_accepted_drafts_per_round_count",
                 "graphburst_gpu_idle_fraction", "graphburst_queue_depth", "graphburst_active_slots",
                 "graphburst_bursts_total", "graphburst_deferred_boundaries_total"):
        assert (name, ()) in after, name
    assert delta("graphburst_deferred_boundaries_total") == 0  # numpy: no GPU timing, so never deferred


def test_a_host_stop_counts_its_rounds_in_the_metrics(server):
    """A stop id checked on the host finishes the request at once; its final update still
    carries the request's accepted drafts and rounds (they were reported as 0 before)."""
    prompt = [8, 8, 1]
    ref = greedy_reference(prompt, 60, VOCAB)
    stops = [absent_token(ref), ref[30]]  # the second id is checked on the host, deep enough for several rounds
    before = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)
    r = httpx.post(server.url + "/v1/completions", timeout=10,
                   json={"prompt": prompt, "max_tokens": 60, "stop_token_ids": stops})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == expected(prompt, 60, stops)
    after = metric_values(httpx.get(server.url + "/metrics", timeout=10).text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("graphburst_requests_total", finish_reason="stop") == 1
    # k=3: 31 tokens take at least 31 / 4 rounds; every round is counted, none dropped
    assert delta("graphburst_spec_rounds_total") >= 8
    assert delta("graphburst_accepted_drafts_per_round_count") == 1


# ---------------------------------------------------------------------- text, shutdown, CLI


def test_text_prompts_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = 300
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    s = ServerProcess("--batch", "2", "--vocab", str(vocab), "--capacity", "256", "--tokenizer", str(tmp_path))
    try:
        ref = greedy_reference([5, 6, 7], 10, vocab)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 10}, timeout=10).json()
        assert r["choices"][0]["token_ids"] == ref and r["choices"][0]["text"] == tok.decode(ref)
        body = {"prompt": ["w5 w6 w7"], "max_tokens": 10, "stream": True}
        lines = httpx.post(s.url + "/v1/completions", json=body, timeout=10).text.splitlines()
        chunks = [json.loads(e)["choices"][0] for e in sse_events(lines)[:-1]]
        assert "".join(c["text"] for c in chunks) == tok.decode(ref)
    finally:
        assert s.terminate() == 0, s.errors()


def test_sigterm_cancels_after_the_drain_timeout_and_exits_0():
    s = ServerProcess("--batch", "1", "--vocab", str(VOCAB), "--capacity", "65536", "--accept", "0",
                      "--drain-timeout", "1")
    with httpx.Client(base_url=s.url, timeout=20) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": [4], "max_tokens": LONG, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            t0 = time.perf_counter()
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while client.get("/health").status_code != 503:  # draining: admissions stop
                assert time.monotonic() < deadline
            assert client.post("/v1/completions", json={"prompt": [1]}).status_code == 503
            events = sse_events(list(lines))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert s.proc.wait(10) == 0, s.errors()
    assert time.perf_counter() - t0 < 8


def test_parse_address():
    from graphburst.serving.http import parse_address

    assert parse_address("8000") == ("127.0.0.1", 8000)
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    for bad in ("", "host:", "1.2.3.4:70000", ":80"):
        with pytest.raises(ValueError, match="--http"):
            parse_address(bad)


def test_bad_http_flag_is_one_line_and_exit_2():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--http", "localhost:http"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--http" in p.stderr, p.stderr


# ---------------------------------------------------------------------- engine thread, in process


def test_idle_engine_thread_sleeps():
    from graphburst import stub_pair
    from graphburst.serving.engine_thread import EngineThread
    from graphburst.serving.loop import ServeLoop

    target, draft = stub_pair(2, VOCAB, 1, 1, 64, backend="numpy")

    async def main():
        engine = EngineThread(ServeLoop(target, draft, k=2, m_rounds=2), asyncio.get_running_loop())
        engine.start()
        cpu0 = time.process_time()
        await asyncio.sleep(0.5)
        used = time.process_time() - cpu0
        engine.stop()
        await asyncio.to_thread(engine.join, 5)
        return used, engine.is_alive()

    used, alive = asyncio.run(main())
    assert used < 0.1 and not alive, used


# ---------------------------------------------------------------------- sampling


def test_sampling_server_reproduces_seeded_requests_and_keeps_greedy_exact():
    """--sampling: temperature 0 is the greedy reference, a seed pins the tokens, bad values are 400s."""
    s = ServerProcess(*SMALL, "--sampling")
    try:
        def complete(**fields):
            r = httpx.post(s.url + "/v1/completions", timeout=30, json={"prompt": [4, 2, 7], "max_tokens": 12,
                                                                         **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert complete(temperature=0) == greedy_reference([4, 2, 7], 12, VOCAB)
        assert complete(top_k=1, temperature=1.0, seed=3) == greedy_reference([4, 2, 7], 12, VOCAB)
        a, b = complete(temperature=1.5, seed=11), complete(temperature=1.5, seed=11)
        assert a == b and len(a) == 12
        others = [complete(temperature=1.5, seed=sd) for sd in (12, 13, 14)]
        assert any(o != a for o in others)  # the seed matters: at this temperature the stubs' rows are flat
        assert complete(temperature=0.7, top_k=-1, top_p=0.9, seed=1)  # vLLM's top_k=-1 means off
        for body, param in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                            ({"seed": -5}, "seed"), ({"top_k": 1.5}, "top_k")):
            r = httpx.post(s.url + "/v1/completions", timeout=10, json={"prompt": [1], **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        assert s.terminate() == 0, s.errors()
