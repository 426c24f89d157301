"""The figures of one open-loop run, from what the clients saw (perf_counter seconds).

Each request's :class:`Record` holds when it was sent and the arrival time and token
count of every SSE chunk that carried tokens. From those:

* **TTFT**: first token chunk's arrival minus the send time.
* **ITL** (the rule): a chunk of ``n`` tokens arriving ``g`` seconds after the request's
  previous token chunk counts ``g`` once and ``0`` for its other ``n - 1`` tokens; the
  first chunk's other ``n - 1`` tokens count ``0`` too. So a request of ``N`` tokens
  gives ``N - 1`` samples summing to its last token's arrival minus its first's, and with
  multi-token chunks (a burst delivers several tokens at once) the p50 is often 0 and the
  p99 is the gap between bursts.
* **TPOT**: per request, (last token's arrival - first token's) / (N - 1): the mean time
  per output token after the first.
* **E2E**: ``data: [DONE]``'s arrival minus the send time.
* **TTFT's parts** (:func:`ttft_split`), from the server's access log, joined on the
  ``X-Request-Id`` each answer carries: **queue** (arrival to a batch slot), **prefill**
  (the slot to the first token on the host, behind the bursts still in flight), **emit**
  (the engine thread's hand-out to the request's handler) and **client** (the client's TTFT
  minus the server's: the first chunk's way out and the client's own time).

Percentiles are numpy's (linear interpolation) over every sample of the run, through
:func:`graphburst.serving.timing.percentiles`.
"""

from __future__ import annotations

import dataclasses
import json

from ..engine.round_exit import BURST_EXIT_REASONS
from ..serving.timing import percentiles

LENGTH_FINISH = "length"  # a request that ran to its max_tokens (the benchmark never stops early)


@dataclasses.dataclass
class Record:
    """What one client saw of one request."""

    scheduled: float  # seconds after the run's start it was due
    prompt_len: int
    max_tokens: int
    sent: float | None = None  # perf_counter when the POST went out
    status: int | None = None  # HTTP status (None: no response)
    chunks: list = dataclasses.field(default_factory=list)  # (arrival perf_counter, tokens in it), token chunks
    tokens: list = dataclasses.field(default_factory=list)
    finish: str | None = None  # the last chunk's finish_reason
    done: float | None = None  # perf_counter of data: [DONE]
    error: str | None = None
    request_id: str | None = None  # the answer's X-Request-Id (the server's access log names it)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def itl_samples(chunks) -> list[float]:
    """Inter-token latencies (seconds) of one request under the module's rule.

    Parameters
    ----------
    chunks : list of (float, int)
        ``(arrival time, tokens in the chunk)`` per token-carrying chunk, in order.
    """
    out = []
    for i, (t, n) in enumerate(chunks):
        if i:
            out.append(t - chunks[i - 1][0])
            out += [0.0] * (n - 1)
        else:
            out += [0.0] * (n - 1)
    return out


def request_figures(rec: Record) -> dict:
    """TTFT, E2E, TPOT (seconds) and ITL samples of one finished request."""
    first, last = rec.chunks[0][0], rec.chunks[-1][0]
    n = len(rec.tokens)
    return dict(ttft=first - rec.sent, e2e=rec.done - rec.sent, tpot=(last - first) / (n - 1) if n > 1 else None,
                itl=itl_samples(rec.chunks))


def _ms(xs) -> dict:
    return percentiles([x * 1e3 for x in xs])


def summarize(records: list[Record], *, rate: float, duration: float, wall: float) -> dict:
    """One row of the table: the run at ``rate`` requests/s (Poisson) over ``duration`` s.

    ``wall``: seconds from the run's start to the last request's end (success or not).
    Rates are over ``span`` = max(duration, wall): the arrival window at least, so a server
    that keeps up achieves the offered rate (not more, as a short tail would give).
    Latencies are in milliseconds; percentiles over the successful requests only.
    """
    good = [r for r in records if r.ok]
    figs = [request_figures(r) for r in good]
    tokens = sum(len(r.tokens) for r in good)
    rejected = sum(1 for r in records if r.status == 429)
    span = max(duration, wall)
    return dict(
        rate=rate, requests=len(records), offered_rps=len(records) / duration, wall_s=wall, span_s=span,
        completed=len(good), rejected_429=rejected, errors=len(records) - len(good) - rejected,
        achieved_rps=len(good) / span, output_tokens=tokens, output_tokens_per_s=tokens / span,
        prompt_tokens=sum(r.prompt_len for r in good),
        ttft_ms=_ms([f["ttft"] for f in figs]), itl_ms=_ms([x for f in figs for x in f["itl"]]),
        # the longest stall any stream saw (a whole prompt's prefill between two bursts shows here)
        itl_max_ms=max((x * 1e3 for f in figs for x in f["itl"]), default=None),
        tpot_ms=_ms([f["tpot"] for f in figs if f["tpot"] is not None]), e2e_ms=_ms([f["e2e"] for f in figs]),
        first_errors=sorted({r.error or f"HTTP {r.status}" for r in records if not r.ok and r.status != 429})[:3])


#: the start of a ladder burst count's sample name, before its rounds label's value
LADDER_SAMPLE = 'graphburst_ladder_bursts_total{rounds="'

def server_window(before: dict, after: dict) -> dict:
    """The server's side of one run, from two ``/metrics`` scrapes (sample name -> value).

    GPU idle fraction of the window = idle seconds / (busy + idle seconds) between the two
    (the counters cover the gaps while a request held a slot; None without GPU timing), and
    the part of it in admission spans (prefill: ``serving/timing.py``);
    accepted drafts per speculative round, of the requests that finished in the window.
    """
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    busy, idle = delta("graphburst_gpu_busy_seconds_total"), delta("graphburst_gpu_idle_seconds_total")
    admission = delta("graphburst_gpu_admission_seconds_total")
    rounds = delta("graphburst_spec_rounds_total")
    total = busy + idle
    return dict(gpu_busy_s=busy, gpu_idle_s=idle, gpu_idle_fraction=idle / total if total > 0 else None,
                gpu_admission_s=admission, gpu_admission_fraction=admission / total if total > 0 else None,
                bursts=int(delta("graphburst_bursts_total")),
                rounds_per_burst=delta("graphburst_burst_rounds_total") / delta("graphburst_bursts_total")
                if delta("graphburst_bursts_total") else None,
                accepted_per_round=delta("graphburst_draft_accepted_total") / rounds if rounds else None,
                # device-exit bursts by why they ended (all 0 with fixed-M bursts)
                burst_exits={r: int(delta(f'graphburst_burst_exits_total{{reason="{r}"}}'))
                             for r in BURST_EXIT_REASONS},
                # a ladder's bursts by their rounds (empty without a ladder)
                ladder_bursts={name[len(LADDER_SAMPLE):-2]: int(delta(name)) for name in sorted(after)
                               if name.startswith(LADDER_SAMPLE)})


#: TTFT's parts: the access log's field of each
SPLIT_FIELDS = {"queue": "queue_ms", "prefill": "prefill_ms", "emit": "emit_ms"}


def read_access_log(path: str) -> dict:
    """The server's access-log lines by request id (a line that is not whole JSON, the last
    one being written, say, is skipped)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and entry.get("request_id") is not None:
                out[entry["request_id"]] = entry
    return out


def ttft_split(records: list[Record], log: dict) -> dict:
    """Percentiles (ms) of TTFT's parts over the successful requests the access log ``log``
    (:func:`read_access_log`) names, and how many it named."""
    parts = {name: [] for name in (*SPLIT_FIELDS, "client")}
    found = 0
    for rec in records:
        entry = log.get(rec.request_id) if rec.ok else None
        if entry is None or entry.get("ttft_ms") is None:
            continue
        found += 1
        for name, field in SPLIT_FIELDS.items():
            if entry.get(field) is not None:
                parts[name].append(entry[field])
        parts["client"].append((rec.chunks[0][0] - rec.sent) * 1e3 - entry["ttft_ms"])
    return {"ttft_split_ms": {name: percentiles(xs) for name, xs in parts.items()}, "ttft_split_requests": found}
