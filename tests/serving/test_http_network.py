"""The HTTP server on a network: API keys, TLS, request ids, the access log, CORS, the exposure warning.

Each server is a subprocess (``graphburst serve --http``, numpy backend, small stubs) over a
real socket; tokens are checked against the CPU greedy oracle, which is what the server
answers without a key.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from graphburst import greedy_reference

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
from test_http_server import MODEL, ROOT, SMALL, VOCAB, ServerProcess, metric_values

from graphburst.serving import network

START_TIMEOUT_S = 60.0
KEY, FILE_KEY, ENV_KEY = "k1-flag-0123456789", "k2-file-abcdefghij", "k3-env-ZYXWVUTSRQ"
ORIGIN = "http://app.example"
PROMPT = [17, 4000, 23, 5]
TEXT = "THE-PROMPT-TEXT-NO-LOG-MAY-HOLD"


def net_server(*flags, host="127.0.0.1", env=None, base=SMALL) -> ServerProcess:
    """``graphburst serve --http HOST:0 --backend numpy BASE FLAGS`` (:class:`ServerProcess`)."""
    return ServerProcess(*base, *flags, host=host, env=env, start_timeout=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Keys from the flag, a file and the environment; /metrics needs one; CORS for ORIGIN; a log file.
    Bound to 0.0.0.0: with a key there is no warning."""
    d = tmp_path_factory.mktemp("keyed")
    key_file, log = d / "keys", d / "access.log"
    key_file.write_text(f"# the team's keys\n\n  {FILE_KEY}  \n# old: retired\n")
    s = net_server("--api-key", KEY, "--api-key-file", str(key_file), "--metrics-need-key",
                  "--allowed-origins", ORIGIN, "--access-log", str(log), host="0.0.0.0",
                  env={network.KEY_ENV: ENV_KEY})
    s.log = log
    yield s
    s.stop()
    for secret in (KEY, FILE_KEY, ENV_KEY):
        assert secret not in s.errors() and secret not in log.read_text()


@pytest.fixture(scope="module")
def open_server():
    """No key, bound to 0.0.0.0: the warning, an open /metrics, the access log on stderr."""
    s = net_server(host="0.0.0.0")
    yield s
    s.stop()


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def metrics(s, key=KEY) -> dict:
    return metric_values(httpx.get(s.url + "/metrics", headers=auth(key), timeout=10).text)


def log_lines(path_or_text, want: int, *, timeout=10.0) -> list:
    """The access log's JSON lines (at least ``want``; a stream's line follows its last chunk)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path_or_text() if callable(path_or_text) else Path(path_or_text).read_text()
        lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
        if len(lines) >= want or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def check_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
    for secret in (KEY, FILE_KEY, ENV_KEY):
        assert secret not in r.text
    assert r.headers["X-Request-Id"]


# ---------------------------------------------------------------------- API keys


BAD_HEADERS = {
    "missing": {},
    "wrong": auth(KEY[:-1] + "X"),  # the same length
    "wrong-length": auth(KEY + "-longer"),
    "wrong-short": auth("k"),
    "malformed": {"Authorization": KEY},  # no "Bearer"
    "basic": {"Authorization": f"Basic {KEY}"},
    "empty": {"Authorization": "Bearer"},
}
REASON = {"missing": "missing", "wrong": "wrong", "wrong-length": "wrong", "wrong-short": "wrong",
          "malformed": "malformed", "basic": "malformed", "empty": "malformed"}


def test_bad_keys_are_401_and_queue_nothing(keyed):
    before = metrics(keyed)
    body = {"prompt": PROMPT, "max_tokens": 8}
    for headers in BAD_HEADERS.values():
        for route in ("/v1/completions", "/v1/chat/completions"):
            check_401(httpx.post(keyed.url + route, json=body, headers=headers, timeout=10))
        check_401(httpx.get(keyed.url + "/v1/models", headers=headers, timeout=10))
        check_401(httpx.get(keyed.url + "/v1/no-such-route", headers=headers, timeout=10))  # 401 before 404
        check_401(httpx.get(keyed.url + "/metrics", headers=headers, timeout=10))  # --metrics-need-key
    after = metrics(keyed)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    for reason in network.AUTH_REASONS:
        want = 5 * sum(1 for c in BAD_HEADERS if REASON[c] == reason)
        assert delta("graphburst_http_auth_rejected_total", reason=reason) == want, reason
    assert delta("graphburst_http_rejected_total", code="401") == 5 * len(BAD_HEADERS)
    assert delta("graphburst_prompt_tokens_total") == 0  # nothing was queued
    assert delta("graphburst_generation_tokens_total") == 0
    assert after[("graphburst_active_slots", ())] == 0 and after[("graphburst_queue_depth", ())] == 0


@pytest.mark.parametrize("key", [KEY, FILE_KEY, ENV_KEY], ids=["flag", "file", "env"])
def test_each_key_source_works(keyed, key):
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 20}, headers=auth(key),
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy_reference(PROMPT, 20, VOCAB)
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {key}"}, timeout=10).status_code == 200


def test_health_is_open(keyed):
    r = httpx.get(keyed.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_openai_client_api_key(keyed):
    ref = greedy_reference(PROMPT, 24, VOCAB)
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, timeout=30, max_retries=0)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24).choices[0].token_ids == ref
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stream=True)
    assert [t for c in streamed for t in c.choices[0].token_ids] == ref
    for bad in ("wrong-key", KEY[:-1] + "X"):
        client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=bad, timeout=30, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert info.value.code == "invalid_api_key"


# ---------------------------------------------------------------------- request ids and the access log


def test_request_id_and_access_log(keyed):
    n0 = len(log_lines(keyed.log, 0))
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6},
                   headers={**auth(KEY), "X-Request-Id": "client-id-42"}, timeout=30)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "client-id-42"
    assert r.json()["id"] == "cmpl-client-id-42"
    # the same id twice at once is the client's business: both are served
    with httpx.Client(timeout=30, headers={**auth(KEY), "X-Request-Id": "dup"}) as c:
        lines = []
        with c.stream("POST", keyed.url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 6, "stream": True}) as s:
            assert s.headers["X-Request-Id"] == "dup"
            lines = [x for x in s.iter_lines() if x.startswith("data: {")]
        assert {json.loads(x[6:])["id"] for x in lines} == {"cmpl-dup"}
    made = httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, headers=auth(KEY),
                      timeout=30)
    rid = made.headers["X-Request-Id"]
    assert len(rid) == 32 and int(rid, 16) >= 0 and made.json()["id"] == f"cmpl-{rid}"
    for bad in ("has space", "x" * 129, "tab\there"):  # refused ids are replaced
        got = httpx.get(keyed.url + "/v1/models", headers={**auth(KEY), "X-Request-Id": bad}, timeout=10)
        assert got.headers["X-Request-Id"] != bad and len(got.headers["X-Request-Id"]) == 32
    text = httpx.post(keyed.url + "/v1/completions", json={"prompt": TEXT, "max_tokens": 3},
                      headers={**auth(KEY), "X-Request-Id": "text-prompt"}, timeout=30)
    assert text.status_code == 400 and text.headers["X-Request-Id"] == "text-prompt"  # stubs: no tokenizer
    denied = httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT}, headers={"X-Request-Id": "denied"},
                        timeout=10)
    assert denied.status_code == 401 and denied.headers["X-Request-Id"] == "denied"

    records = log_lines(keyed.log, n0 + 8)[n0:]
    by_id = {r["request_id"]: r for r in records}
    first = by_id["client-id-42"]
    assert set(first) == {"time", "request_id", "client", "method", "route", "status", "prompt_tokens",
                          "completion_tokens", "ttft_ms", "queue_ms", "prefill_ms", "emit_ms", "duration_ms",
                          "finish_reasons"}
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert (first["client"], first["method"], first["route"], first["status"]) == ("127.0.0.1", "POST",
                                                                                    "/v1/completions", 200)
    assert (first["prompt_tokens"], first["completion_tokens"], first["finish_reasons"]) == (4, 6, ["length"])
    assert first["ttft_ms"] > 0 and first["duration_ms"] >= first["ttft_ms"]
    # TTFT's parts: the wait for a slot and the prefill add up to it (the log rounds each to 1 µs)
    assert first["queue_ms"] >= 0 and first["prefill_ms"] > 0 and first["emit_ms"] >= 0
    assert first["queue_ms"] + first["prefill_ms"] == pytest.approx(first["ttft_ms"], abs=0.01)
    assert by_id["text-prompt"]["queue_ms"] is None and by_id["text-prompt"]["prefill_ms"] is None
    assert by_id["dup"]["completion_tokens"] == 6 and by_id["dup"]["status"] == 200
    assert by_id[rid]["completion_tokens"] == 3
    assert by_id["text-prompt"]["status"] == 400 and by_id["text-prompt"]["ttft_ms"] is None
    assert by_id["denied"]["status"] == 401 and by_id["denied"]["prompt_tokens"] is None
    raw = Path(keyed.log).read_text()
    assert TEXT not in raw and all(k not in raw for k in (KEY, FILE_KEY, ENV_KEY))


def test_access_log_on_stderr_and_generated_ids(open_server):
    r = httpx.post(open_server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200
    rid = r.headers["X-Request-Id"]
    assert r.json()["id"] == f"cmpl-{rid}"
    err = httpx.get(open_server.url + "/nowhere", timeout=10)
    assert err.status_code == 404 and err.headers["X-Request-Id"]
    records = {x["request_id"]: x for x in log_lines(open_server.errors, 2)}
    assert records[rid]["completion_tokens"] == 5 and records[rid]["status"] == 200
    assert records[err.headers["X-Request-Id"]]["status"] == 404


def test_chat_ids_and_no_text_in_the_log(tmp_path):
    pytest.importorskip("transformers")
    from test_http_chat import CHAT_FLAGS, TEMPLATE, save_tokenizer

    save_tokenizer(tmp_path / "tok", template=TEMPLATE)
    log = tmp_path / "access.log"
    s = net_server("--tokenizer", str(tmp_path / "tok"), "--api-key", KEY, "--access-log", str(log), base=CHAT_FLAGS)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, timeout=30, max_retries=0)
        words = "w17 w42 w99 w123 w250"
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=8,
            extra_headers={"X-Request-Id": "chat-7"})
        assert raw.headers["X-Request-Id"] == "chat-7"
        chat = raw.parse()
        assert chat.id == "chatcmpl-chat-7" and chat.choices[0].message.content
        done = client.completions.create(model=MODEL, prompt="w31 w32 w33 w34", max_tokens=8,
                                         extra_headers={"X-Request-Id": "text-8"})
        assert done.id == "cmpl-text-8" and done.choices[0].text
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}],
                                                max_tokens=8, stream=True, extra_headers={"X-Request-Id": "chat-9"})
        assert {c.id for c in stream} == {"chatcmpl-chat-9"}
        records = {r["request_id"]: r for r in log_lines(log, 3)}
        assert records["chat-7"]["route"] == "/v1/chat/completions" and records["chat-7"]["completion_tokens"] == 8
        assert records["chat-9"]["finish_reasons"] == ["length"]
        text = log.read_text()
        for secret in (words, "w31 w32", chat.choices[0].message.content.strip(), done.choices[0].text.strip(), KEY):
            assert secret not in text, secret
    finally:
        s.stop()


# ---------------------------------------------------------------------- /metrics, CORS, the warning


def test_metrics_open_without_metrics_need_key(open_server, keyed):
    r = httpx.get(open_server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "graphburst_http_auth_rejected_total" in r.text
    assert httpx.get(keyed.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers=auth(FILE_KEY), timeout=10).status_code == 200


def test_cors(keyed, open_server):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(keyed.url + "/v1/completions", headers=pre, timeout=10)  # a preflight carries no key
    assert ok.status_code == 204
    assert ok.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    assert ok.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   headers={**auth(KEY), "Origin": ORIGIN}, timeout=30)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    denied = httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT}, headers={"Origin": ORIGIN}, timeout=10)
    assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == ORIGIN  # readable by the page

    other = {**pre, "Origin": "http://evil.example"}
    for s in (keyed, open_server):  # another origin, or a server with no --allowed-origins: no CORS header
        r = httpx.options(s.url + "/v1/completions", headers=other, timeout=10)
        assert r.status_code in (401, 405) and not any(h.lower().startswith("access-control-") for h in r.headers)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       headers={**auth(KEY), "Origin": "http://evil.example"}, timeout=30)
        assert not any(h.lower().startswith("access-control-") for h in r.headers)


WARNING = "with no API key"


def test_exposure_warning(keyed, open_server):
    assert sum(WARNING in line for line in open_server.errors().splitlines()) == 1  # 0.0.0.0, no key
    assert WARNING not in keyed.errors()  # 0.0.0.0 with keys


def test_exposure_warning_rule():
    keyed, bare = network.NetworkOptions(key_digests=(b"x",)), network.NetworkOptions()
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert network.exposure_warning(host, bare) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"):
        assert WARNING in network.exposure_warning(host, bare)
        assert network.exposure_warning(host, keyed) is None


# ---------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    leaf.private_key_pem.write_to_path(str(d / "key.pem"))
    for i, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(str(d / "cert.pem"), append=i > 0)
    other = ca.issue_cert("127.0.0.1")
    other.private_key_pem.write_to_path(str(d / "other-key.pem"))
    (d / "junk.pem").write_text("not a certificate\n")
    return d


def test_tls_round_trip(tls_files):
    d = tls_files
    s = net_server("--ssl-certfile", str(d / "cert.pem"), "--ssl-keyfile", str(d / "key.pem"))  # loopback, no key
    try:
        assert s.url.startswith("https://127.0.0.1:")
        assert WARNING not in s.errors()
        verify = ssl.create_default_context(cafile=str(d / "ca.pem"))
        with httpx.Client(verify=verify, timeout=30) as c:
            r = c.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_reference(PROMPT, 10, VOCAB)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=30, max_retries=0,
                               http_client=httpx.Client(verify=verify))
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].token_ids == \
            greedy_reference(PROMPT, 4, VOCAB)
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(s.url.replace("https://", "http://") + "/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(s.url + "/health", timeout=10)
        with httpx.Client(verify=verify, timeout=30) as c:  # the server serves on
            assert c.get(s.url + "/health").status_code == 200
            assert c.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}).status_code == 200
    finally:
        s.stop()
    assert "Traceback" not in s.errors(), s.errors()


def refused(*flags, env=None) -> str:
    """The stderr of a server that must refuse its flags at start: exit 2, one line."""
    cmd = [sys.executable, "-m", "graphburst.cli", "serve", "--http", "127.0.0.1:0", "--backend", "numpy", *SMALL,
           *flags]
    env = {**{k: v for k, v in os.environ.items() if k != network.KEY_ENV}, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and p.stdout == "", p.stderr
    assert "no GPU" not in p.stderr  # refused before any model was built
    return lines[0]


def test_tls_bad_files(tls_files):
    d = tls_files
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    cases = [  # (flags, the file the line must name)
        (["--ssl-certfile", cert], cert),
        (["--ssl-keyfile", key], key),
        (["--ssl-certfile", str(d / "missing.pem"), "--ssl-keyfile", key], str(d / "missing.pem")),
        (["--ssl-certfile", cert, "--ssl-keyfile", str(d / "other-key.pem")], str(d / "other-key.pem")),
        (["--ssl-certfile", str(d / "junk.pem"), "--ssl-keyfile", key], str(d / "junk.pem")),
        (["--ssl-certfile", cert, "--ssl-keyfile", cert], cert),  # a certificate given as the key
    ]
    if os.geteuid() != 0:  # root reads a file of mode 000 anyway
        locked = d / "locked.pem"
        locked.write_bytes((d / "key.pem").read_bytes())
        locked.chmod(0)
        cases.append((["--ssl-certfile", cert, "--ssl-keyfile", str(locked)], str(locked)))
    for flags, named in cases:
        line = refused(*flags)
        assert line.startswith("graphburst serve: ") and named in line, (flags, line)


def test_key_flags_refused(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing\n\n")
    assert str(empty) in refused("--api-key-file", str(empty))
    assert str(tmp_path / "none") in refused("--api-key-file", str(tmp_path / "none"))
    line = refused("--api-key", "has space inside")
    assert "--api-key" in line and "space inside" not in line
    assert "--metrics-need-key" in refused("--metrics-need-key")


def test_keys_never_in_help_or_config():
    out = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--help"], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT), network.KEY_ENV: ENV_KEY}, timeout=60).stdout
    assert "--api-key-file" in out and "--ssl-certfile" in out and ENV_KEY not in out
    from graphburst.serving.factory import ConfigError, ServeConfig

    config = ServeConfig(http="127.0.0.1:0", api_key=[KEY])
    assert config.api_key == (KEY,) and KEY not in repr(config)
    with pytest.raises(ConfigError) as info:
        ServeConfig(api_key=[KEY])  # JSONL serving has no keys
    assert KEY not in str(info.value)


# ---------------------------------------------------------------------- the pieces


def test_key_checks_in_constant_time_over_every_key():
    digests = tuple(network._digest(k) for k in ("alpha", "beta-longer-key"))
    assert network.auth_failure("Bearer alpha", digests) is None
    assert network.auth_failure("Bearer beta-longer-key", digests) is None
    assert network.auth_failure("bearer  alpha ", digests) is None
    assert network.auth_failure("Bearer alph", digests) == "wrong"
    assert network.auth_failure(None, digests) == "missing"
    assert network.auth_failure("alpha", digests) == "malformed"
    assert network.auth_failure("Bearer", digests) == "malformed"


def test_load_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("a1\n\n# comment\n  b2 \n")
    assert network.load_keys(["f0"], str(f), {network.KEY_ENV: " e3 "}) == ["f0", "a1", "b2", "e3"]
    assert network.load_keys(None, None, {network.KEY_ENV: ""}) == []
    f.write_text("a1\nbad key\n")
    with pytest.raises(ValueError, match="line 2") as info:
        network.load_keys(None, str(f), {})
    assert "bad key" not in str(info.value)


def test_request_id_rule():
    assert network.request_id("abc-DEF_1.2:3") == "abc-DEF_1.2:3"
    assert network.request_id("x" * 128) == "x" * 128
    for bad in (None, "", "x" * 129, "a b", "é", "a\x00"):
        made = network.request_id(bad)
        assert made != bad and len(made) == 32


def test_tensor_parallel_serving_refuses_bad_network_flags_before_any_group(tls_files, tmp_path):
    # Under --tp every rank loads its models before the server's own code runs: the command line
    # checks the network flags first (no torchrun here: a group would fail differently)
    missing = str(tls_files / "missing.pem")
    line = refused("--tp", "2", "--ssl-certfile", missing, "--ssl-keyfile", str(tls_files / "key.pem"))
    assert missing in line and "--ssl-certfile" in line, line
    empty = tmp_path / "keys"
    empty.write_text("# nothing\n")
    assert str(empty) in refused("--tp", "2", "--api-key-file", str(empty))
    assert "--access-log" in refused("--access-log", str(tmp_path / "no-such-folder" / "log.jsonl"))
