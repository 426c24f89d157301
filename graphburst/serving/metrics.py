"""Prometheus metrics of the HTTP server, rendered by ``prometheus_client``.

Request-level metrics (finish reasons, tokens, TTFT, inter-token latency, acceptance) are
updated on the event loop thread as updates arrive from the engine thread. Loop-level
values (GPU idle fraction, queue depth, active slots, bursts) belong to the engine thread's
``ServeLoop``; a custom collector reads the engine's latest stats snapshot at scrape time,
so a scrape never touches the loop itself.

Each server owns its :class:`CollectorRegistry` (no process-global registry), so two
servers in one process, or tests, never share counters.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds. Bursts deliver tokens in groups, so TTFT starts at one burst (~ms on a GPU).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ACCEPT_BUCKETS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _LoopCollector:
    """Loop-level gauges and counters from ``engine.snapshot`` (a dict replaced per update)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.snapshot
        idle = s.get("gpu_idle_fraction")
        yield _gauge("graphburst_gpu_idle_fraction",
                     "Fraction of GPU time idle between bursts since start (NaN without GPU timing)",
                     math.nan if idle is None else idle)
        steady = s.get("gpu_idle_fraction_steady")
        yield _gauge("graphburst_gpu_idle_fraction_steady",
                     "Fraction of GPU time idle between bursts launched with every batch slot running (NaN "
                     "without GPU timing or before any such burst)", math.nan if steady is None else steady)
        for name, key, doc in (("graphburst_gpu_busy_seconds", "gpu_busy_ms", "GPU time in bursts"),
                               ("graphburst_gpu_idle_seconds", "gpu_idle_ms",
                                "GPU time idle between bursts while a request held a slot"),
                               ("graphburst_gpu_admission_seconds", "gpu_admission_ms",
                                "Of the idle time, the spans of admission's device work (prefill)")):
            if key in s:  # counters, so a window's idle fraction is (idle delta) / (busy + idle delta)
                family = CounterMetricFamily(name, doc + " (0 without GPU timing)")
                family.add_metric([], s[key] / 1e3)
                yield family
        yield _gauge("graphburst_queue_depth", "Requests waiting for a batch slot", s.get("waiting", s["queued"]))
        yield _gauge("graphburst_active_slots", "Batch slots holding a running request", s["active_slots"])
        yield _gauge("graphburst_engine_tokens_per_second", "Tokens delivered per second since start",
                     s["tokens_per_s"])
        bursts = CounterMetricFamily("graphburst_bursts", "Bursts drained")
        bursts.add_metric([], s["bursts"])
        yield bursts
        rounds = CounterMetricFamily("graphburst_burst_rounds",
                                     "Rounds the drained bursts ran (M each, fewer where bursts end on the device)")
        rounds.add_metric([], s.get("burst_rounds", 0))
        yield rounds
        exits = CounterMetricFamily("graphburst_burst_exits",
                                    "Drained bursts that ended on the device, by why: m_max rounds run, every slot "
                                    "stopped (idle), or a stop request (flag)", labels=["reason"])
        for reason, n in s.get("burst_exits", {}).items():
            exits.add_metric([reason], n)
        yield exits
        ladder = CounterMetricFamily("graphburst_ladder_bursts",
                                     "Bursts launched from a ladder of burst lengths, by their rounds", labels=["rounds"])
        for rounds, n in s.get("ladder_bursts", {}).items():
            ladder.add_metric([rounds], n)
        yield ladder
        steady = CounterMetricFamily("graphburst_steady_bursts",
                                     "Bursts launched with every batch slot running (timed on a GPU only)")
        steady.add_metric([], s.get("steady_bursts", 0))
        yield steady
        deferred = CounterMetricFamily("graphburst_deferred_boundaries",
                                       "Burst boundaries auto admission let wait a burst, to admit with a later one "
                                       "(the host was the bottleneck)")
        deferred.add_metric([], s.get("deferred_boundaries", 0))
        yield deferred


def _gauge(name, doc, value):
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], float(value))
    return g


class Metrics:
    """Every metric of one server.

    Parameters
    ----------
    engine : EngineThread, optional
        Source of the loop-level snapshot; without one only request metrics are exported.
    """

    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("graphburst_requests", "Finished completion choices by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("graphburst_http_rejected", "HTTP requests refused by status code",
                                ["code"], registry=r)
        # 401s by why the API key was refused: missing, malformed (not "Bearer KEY") or wrong
        self.auth_rejected = Counter("graphburst_http_auth_rejected", "Requests refused for their API key, by reason",
                                     ["reason"], registry=r)
        for reason in ("missing", "malformed", "wrong"):  # exported at 0 from the start
            self.auth_rejected.labels(reason)
        self.prompt_tokens = Counter("graphburst_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("graphburst_generation_tokens", "Tokens generated and sent", registry=r)
        self.ttft = Histogram("graphburst_time_to_first_token_seconds",
                              "From the HTTP request's arrival to its first token", buckets=TTFT_BUCKETS,
                              registry=r)
        # TTFT's two parts on the server: the wait for a batch slot at a burst boundary, then the
        # prefill (behind the bursts still in flight) up to the first token's hand-out
        self.queue_time = Histogram("graphburst_request_queue_time_seconds",
                                    "From the HTTP request's arrival to its batch slot", buckets=TTFT_BUCKETS,
                                    registry=r)
        self.prefill_time = Histogram("graphburst_request_prefill_time_seconds",
                                      "From a request's batch slot to its first token on the host",
                                      buckets=TTFT_BUCKETS, registry=r)
        # One observation per burst delivery: the gap since the request's previous
        # delivery divided by the tokens it carried (per-token latency without one
        # observe() per token on the hot path).
        self.itl = Histogram("graphburst_inter_token_latency_seconds",
                             "Gap between deliveries to one request per token delivered", buckets=ITL_BUCKETS,
                             registry=r)
        self.accepted = Counter("graphburst_draft_accepted", "Draft tokens accepted by the target", registry=r)
        self.rounds = Counter("graphburst_spec_rounds", "Speculative rounds run for finished requests", registry=r)
        self.accept_per_round = Histogram("graphburst_accepted_drafts_per_round",
                                          "Accepted drafts per round, one observation per finished request",
                                          buckets=ACCEPT_BUCKETS, registry=r)
        if engine is not None:
            r.register(_LoopCollector(engine))

    def finished(self, reason: str, accepted: int, rounds: int) -> None:
        self.requests.labels(reason).inc()
        if rounds:
            self.accepted.inc(accepted)
            self.rounds.inc(rounds)
            self.accept_per_round.observe(accepted / rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
