"""``graphburst bench serve --profile``: where the serving loop's host time and the GPU's idle go.

One workload, the zero-cost ``refill`` workload of ``bench serve``: ``--refill-requests``
(default 4x ``--batch``: 256) requests of 16-token prompts and ``--new-tokens`` (256) new
tokens each, through ``--batch`` (64) slots of stubs, k=4, M=8, all submitted at once, so
slots finish and are refilled at burst boundaries. ``--model SHAPE`` runs a random-weight
shape of ``bench real`` instead (prompt and output lengths lognormal, mean 128, in [16, 512],
as the open-loop load benchmark draws them): the loop's own idle under a real model.

Each view is its own runs of fresh loops (its timers would weigh on the others' figures), one
per ``--pipeline-depth`` and ``--repeats``; before anything is timed a warm-up request through
the loop must equal the greedy reference, and so must every request of every run afterwards
(``--model``: each request must get all its tokens, random weights having no oracle). Figures are
medians over the runs' steps. Three tables, JSON beside them (``--json``):

- **boundary**: host µs of a burst boundary by phase (freeing, taking waiting requests, the
  decoder's admission: options, staging, the admission graph or the models' prefill and the
  slot writes, its host record), over the boundaries that admitted, and of the plain steps'
  drain (its wait for the GPU apart), delivery and step; on a GPU the burst clock's busy, idle
  and admission-span time.
- **host**: host µs per step by phase (drain, launch, deliver, boundary, the rest), with the
  device's work left out (on numpy it runs on the host, inside the graph launches: timed and
  taken out) and the drain's wait for the GPU apart.
- **gaps**: GPU idle by what preceded each launch: every burst's gap (the burst clock's) goes to
  its launch's category, **admit** (the launch right after an admitting boundary), **after**
  (the launch after that one) or **plain**; numpy has no device clock (launches counted, no idle).

Every phase is timed by wrapping a method of this loop's own objects by name (:data:`PHASES`,
the one table of them): instrumentation, nothing on the serving path changes.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console

from ..serving.loop import ServeLoop
from ..serving.request import Request
from .common import VOCAB, check_greedy, fmt, label, new_table, stub_models, write_results

PROMPT_TOKENS = 16  # the refill workload's prompts
SHAPE_MAX = 512  # --model: prompt and output lengths lognormal, mean 128, in [16, SHAPE_MAX] (the load benchmark's)
SHAPE_MEAN, SHAPE_MIN, SHAPE_SIGMA = 128, 16, 0.5
GAP_CATEGORIES = ("plain", "admit", "after")

#: Every method a view wraps: ``{view: ((label, owner, method), ...)}``. ``owner`` is an attribute
#: path from the loop ("" is the loop itself); ``name[]`` means each item of that list (the item is
#: then replaced by a timing proxy: CUDA events and graphs take no attributes). Inclusive times: a
#: phase called inside another counts in both.
PHASES = {
    "boundary": (
        ("boundary", "boundary", "run"),  # the whole boundary
        ("free", "boundary", "free_finished"),  # freeing the slots of finished requests ...
        ("release", "dec.admission", "release"),  # ... their decoder half
        ("take", "boundary", "take_waiting"),  # taking waiting requests into free slots
        ("prefill", "dec.admission", "prefill_slots"),  # the decoder's admission, all of it:
        ("options", "dec.admission", "_apply_options"),  # models applying their own options
        ("stage", "dec.admission", "stage"),  # the staging upload
        ("graph", "dec.admission", "admit_in_graph"),  # the admission graph's launch (prefill and slot writes)
        ("models", "dec.admission", "prefill_models"),  # eagerly: the models' prefill calls ...
        ("admit", "dec.admission", "admit"),  # ... and the slot writes
        ("record", "dec.admission", "record"),  # the host's record of the admission
        ("drain", "pipeline", "drain"),
        ("wait", "pipeline.graph._events[]", "synchronize"),  # the drain's wait for the GPU
        ("deliver", "delivery", "deliver"),
        ("step", "", "step"),
    ),
    "host": (
        ("drain", "pipeline", "drain"),
        ("wait", "pipeline.graph._events[]", "synchronize"),
        ("launch", "pipeline", "launch"),
        ("deliver", "delivery", "deliver"),
        ("boundary", "boundary", "run"),
        # numpy runs the device's work on the host, inside these: taken out of launch and boundary
        ("burst_device", "pipeline.graph._graphs[]", "launch"),  # a burst's recorded program
        ("admission_device", "dec.admission", "admit_in_graph"),  # an admission graph's
    ),
    "gaps": (
        ("launch", "pipeline", "launch"),
        ("gap", "pipeline.clock", "record"),  # each drained burst's busy and gap ms
        ("admitted", "dec.admission", "prefill_slots"),  # slots prefilled (final chunks: admitted)
    ),
}
#: boundary view: the phases shown per admitting boundary, and per plain step (no boundary ran)
BOUNDARY_ROWS = ("free", "release", "take", "prefill", "options", "stage", "graph", "models", "admit", "record",
                 "boundary", "drain", "wait", "deliver", "step")
PLAIN_ROWS = ("drain", "wait", "deliver", "step")
HOST_COLUMNS = ("drain", "wait", "launch", "deliver", "boundary", "other", "total")


# ---------------------------------------------------------------------- instrumentation


def owners(loop: ServeLoop, path: str) -> list:
    """The objects at ``path`` from ``loop`` (:data:`PHASES`' owners); ``[]`` a list's items, as
    ``(list, index)`` pairs. Raises AttributeError naming a missing step, so a rename fails."""
    objs = [loop]
    for part in path.split(".") if path else ():
        if part.endswith("[]"):
            objs = [(getattr(obj, part[:-2]), i) for obj in objs for i in range(len(getattr(obj, part[:-2])))]
        else:
            objs = [getattr(obj, part) for obj in objs]
    return objs


class _Timed:
    """A list item whose one method is timed; everything else goes to the item."""

    def __init__(self, item, method: str, timed):
        self._item = item
        setattr(self, method, timed)

    def __getattr__(self, name):
        return getattr(self._item, name)


class PhaseTimer:
    """Seconds and first-argument lengths per label of the methods a view wraps on one loop.

    ``hooks``: ``{label: hook(args, kwargs)}`` called after a wrapped call (the gaps view's tags).
    A context manager: leaving it unwraps every method. A wrapper holds its object's own method,
    a cycle that would leave a dead loop's graphs to the cyclic collector, which may run inside a
    later loop's capture and invalidate it.
    """

    def __init__(self, loop: ServeLoop, view: str, hooks: dict | None = None):
        self.labels = tuple(dict.fromkeys(label for label, _, _ in PHASES[view]))
        self.spent = dict.fromkeys(self.labels, 0.0)
        self.items = dict.fromkeys(self.labels, 0)
        self.hooks = hooks or {}
        self._undo = []  # (owner, method) wrapped on an instance; (list, index, item) replaced by a proxy
        for phase, path, method in PHASES[view]:
            for owner in owners(loop, path):
                if isinstance(owner, tuple):  # a list's item: replaced by a proxy
                    items, i = owner
                    self._undo.append((items, i, items[i]))
                    items[i] = _Timed(items[i], method, self._wrap(getattr(items[i], method), phase))
                else:
                    self._undo.append((owner, method))
                    setattr(owner, method, self._wrap(getattr(owner, method), phase))

    def __enter__(self) -> PhaseTimer:
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            if len(undo) == 3:
                items, i, item = undo
                items[i] = item
            else:
                owner, method = undo
                vars(owner).pop(method, None)  # the class's method shows again
        self._undo.clear()

    def _wrap(self, real, phase: str):
        spent, items, hook = self.spent, self.items, self.hooks.get(phase)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                out = real(*a, **kw)
            finally:
                spent[phase] += time.perf_counter() - t
            if a and isinstance(a[0], list):
                items[phase] += len(a[0])
            if hook is not None:
                hook(a, kw)
            return out

        return timed

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.spent), dict(self.items)


# ---------------------------------------------------------------------- the workload


def _workload(shape: dict, vocab: int, rng) -> list:
    """The workload's requests, drawn from ``rng``: the refill workload's, or a shape's lognormal lengths."""
    if shape["model"] is None:
        return [Request(rng.integers(0, VOCAB, PROMPT_TOKENS).tolist(), shape["new_tokens"], options={"seed": i})
                for i in range(shape["requests"])]
    lens = np.clip(np.rint(rng.lognormal(np.log(SHAPE_MEAN) - SHAPE_SIGMA**2 / 2, SHAPE_SIGMA, (2, shape["requests"]))),
                   SHAPE_MIN, SHAPE_MAX).astype(int)
    return [Request(rng.integers(0, vocab, p).tolist(), int(n)) for p, n in lens.T]


def _capacity(shape: dict) -> int:
    burst = shape["m"] * (shape["k"] + 1)
    return (2 * SHAPE_MAX if shape["model"] else 64 + shape["new_tokens"]) + burst


def build_loop(backend, shape: dict, depth: int) -> ServeLoop:
    """A fresh loop of the workload's models, warmed (kernels compiled, graphs captured) by one
    request whose tokens must equal the greedy reference (stubs)."""
    if shape["model"] is None:
        target, draft = stub_models(backend, batch=shape["batch"], capacity=_capacity(shape))
    else:
        from .load_server import shape_models

        target, draft = shape_models(shape["model"], batch=shape["batch"], capacity=_capacity(shape), k=shape["k"],
                                     dtype="bfloat16", eps=0.01, seed=0, backend=backend, lookup=False)
    loop = ServeLoop(target, draft, k=shape["k"], m_rounds=shape["m"], depth=depth,
                     admission=shape["admission"], prefill_chunk=shape["prefill_chunk"])
    warm = loop.submit(Request([1, 2, 3], shape["m"] * (shape["k"] + 1)))
    loop.run_until_idle()
    _check(shape, "warm-up", [warm])
    return loop


def _check(shape: dict, what: str, states: list) -> None:
    """Stubs: every request's tokens are the greedy reference's; a shape: every request got all its tokens."""
    bad = [s for s in states if s.error or len(s.tokens) != s.request.max_new_tokens]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} requests without all their tokens ({bad[0].error})")
    if shape["model"] is None:
        check_greedy(what, [s.request.prompt for s in states], [s.tokens for s in states])


def _median(rows: list, key: str) -> float | None:
    return float(np.median([r[key] for r in rows])) if rows else None


# ---------------------------------------------------------------------- the views


def profile_boundary(backend, shape: dict, depth: int, repeats: int) -> dict:
    """Host µs of an admitting boundary by phase, and of the plain steps; GPU busy, idle, admission spans."""
    admitting, plain, runs = [], [], []
    for _ in range(repeats):
        loop = build_loop(backend, shape, depth)
        overall = loop.pipeline.clock.overall
        busy0, idle0, adm0 = overall.busy_ms, overall.idle_ms, overall.admission_ms
        states = [loop.submit(r) for r in _workload(shape, loop.vocab, np.random.default_rng(0))]
        boundaries = steps = 0
        bursts0 = loop.bursts  # the warm-up's are not the workload's
        with PhaseTimer(loop, "boundary") as timer:
            t0 = time.perf_counter()
            while not loop.idle:
                spent0, items0 = timer.snapshot()
                loop.step()
                steps += 1
                spent, items = timer.snapshot()
                row = {k: (spent[k] - spent0[k]) * 1e6 for k in spent} | {"slots": items["prefill"] - items0["prefill"]}
                if spent["boundary"] != spent0["boundary"]:
                    boundaries += 1
                    if row["slots"]:
                        admitting.append(row)
                else:
                    plain.append(row)
            wall = time.perf_counter() - t0
        _check(shape, f"boundary view, depth {depth}", states)
        gpu = backend.is_gpu
        busy, idle = overall.busy_ms - busy0, overall.idle_ms - idle0
        runs.append({"wall_ms": wall * 1e3, "steps": steps, "bursts": loop.bursts - bursts0, "boundaries": boundaries,
                     "deferred_boundaries": loop.schedule.deferred_boundaries,
                     "host_us_per_step": timer.spent["step"] * 1e6 / max(steps, 1),
                     "gpu_busy_ms": busy if gpu else None, "gpu_idle_ms": idle if gpu else None,
                     "gpu_idle_fraction": idle / (busy + idle) if gpu and busy + idle > 0 else None,
                     "gpu_admission_ms": overall.admission_ms - adm0 if gpu else None})
    n_admitting = len(admitting) // repeats
    return {"view": "boundary", "depth": depth, "repeats": repeats, "admitting_boundaries_per_run": n_admitting,
            "median_us_per_admitting_boundary": {k: _median(admitting, k) for k in (*BOUNDARY_ROWS, "slots")},
            "median_us_per_plain_step": {k: _median(plain, k) for k in PLAIN_ROWS},
            "runs": runs, **{k: _median(runs, k) for k in ("wall_ms", "bursts", "boundaries", "deferred_boundaries",
                                                           "host_us_per_step")},
            "gpu_idle_fraction": _median(runs, "gpu_idle_fraction") if backend.is_gpu else None,
            "gpu_admission_ms": _median(runs, "gpu_admission_ms") if backend.is_gpu else None}


def profile_host(backend, shape: dict, depth: int, repeats: int) -> dict:
    """Host µs per step by phase, the drain's wait for the GPU apart; on numpy the device's work
    (the graphs' recorded programs, run on the host) is timed and taken out of the phase it ran in."""
    rows, bursts, host_s = [], 0, 0.0
    on_host = not backend.is_gpu  # on a GPU a graph launch is the host's own (asynchronous) cost
    for _ in range(repeats):
        loop = build_loop(backend, shape, depth)
        states = [loop.submit(r) for r in _workload(shape, loop.vocab, np.random.default_rng(0))]
        bursts0, taken_out = loop.bursts, 0.0
        with PhaseTimer(loop, "host") as timer:
            t0 = time.perf_counter()
            while not loop.idle:
                spent0 = timer.snapshot()[0]
                t = time.perf_counter()
                loop.step()
                total = time.perf_counter() - t
                spent = timer.snapshot()[0]
                d = {k: spent[k] - spent0[k] for k in spent}
                burst_dev, admission_dev = (d["burst_device"], d["admission_device"]) if on_host else (0.0, 0.0)
                out = d["wait"] + burst_dev + admission_dev
                taken_out += out
                row = {"drain": d["drain"] - d["wait"], "wait": d["wait"], "launch": d["launch"] - burst_dev,
                       "deliver": d["deliver"], "boundary": d["boundary"] - admission_dev, "total": total - out,
                       "device": burst_dev + admission_dev}
                row["other"] = row["total"] - sum(row[k] for k in ("drain", "launch", "deliver", "boundary"))
                rows.append({k: v * 1e6 for k, v in row.items()})
            wall = time.perf_counter() - t0
        _check(shape, f"host view, depth {depth}", states)
        bursts += loop.bursts - bursts0
        host_s += wall - taken_out
    return {"view": "host", "depth": depth, "repeats": repeats, "steps": len(rows), "bursts": bursts,
            "mean_host_us_per_burst": host_s * 1e6 / max(bursts, 1),
            "median_us_per_step": {k: _median(rows, k) for k in (*HOST_COLUMNS, "device")}}


def classify(admitted: list, gaps: list) -> dict:
    """Gaps by category. ``admitted[i]``: requests admitted before launch i; ``gaps[i]``: the GPU
    idle ms before burst i (None: not counted). Returns ``{category: (launches, idle µs)}`` and the
    plain gaps' median and p90 (µs)."""
    out = {c: [0, 0.0] for c in GAP_CATEGORIES}
    plain = []
    for i in range(1, min(len(admitted), len(gaps))):
        gap = gaps[i] or 0.0
        cat = "admit" if admitted[i] else ("after" if admitted[i - 1] else "plain")
        out[cat][0] += 1
        out[cat][1] += gap * 1e3
        if cat == "plain":
            plain.append(gap * 1e3)
    result = {c: (n, round(us, 1)) for c, (n, us) in out.items()}
    result["plain_p50_us"] = round(float(np.percentile(plain, 50)), 1) if plain else None
    result["plain_p90_us"] = round(float(np.percentile(plain, 90)), 1) if plain else None
    return result


def profile_gaps(backend, shape: dict, depth: int, repeats: int) -> list:
    """``repeats`` runs of the workload through one warmed loop: GPU idle by what preceded each launch."""
    admitted, gaps, since = [], [], [0]

    def on_launch(args, kw):  # tagged after the launch: the requests admitted since the previous one
        admitted.append(since[0])
        since[0] = 0

    def on_gap(args, kw):
        gaps.append((args[0], args[1]))  # record(busy_ms, gap_ms, steady, ...)

    def on_prefill(args, kw):
        if kw.get("final", True):
            since[0] += len(args[0])

    loop = build_loop(backend, shape, depth)
    rows = []
    for i in range(repeats):
        admitted.clear(), gaps.clear()
        states = [loop.submit(r) for r in _workload(shape, loop.vocab, np.random.default_rng(i))]
        with PhaseTimer(loop, "gaps", hooks={"launch": on_launch, "gap": on_gap, "admitted": on_prefill}):
            t0 = time.perf_counter()
            loop.run_until_idle()
            wall = (time.perf_counter() - t0) * 1e3
        _check(shape, f"gaps view, depth {depth}", states)
        busy = sum(b for b, _ in gaps)
        idle = sum(g or 0.0 for _, g in gaps)
        row = {"view": "gaps", "depth": depth, "run": i, "wall_ms": round(wall, 2), "bursts": len(admitted),
               "timed": bool(gaps), "idle_pct": round(100 * idle / (busy + idle), 1) if busy + idle else None,
               "burst_us": round(1e3 * busy / len(gaps), 1) if gaps else None}
        row.update(classify(admitted, [g for _, g in gaps]) if gaps else {})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- the command


def run(args, console: Console, backend) -> int:
    shape = {"model": args.model, "requests": args.refill_requests, "new_tokens": args.new_tokens,
             "batch": args.batch, "k": args.k, "m": args.rounds, "admission": args.admission or "auto",
             "prefill_chunk": args.prefill_chunk}
    depths, repeats = args.pipeline_depth, args.repeats
    boundary = [profile_boundary(backend, shape, d, repeats) for d in depths]
    host = [profile_host(backend, shape, d, repeats) for d in depths]
    gaps = [row for d in depths for row in profile_gaps(backend, shape, d, repeats)]
    what = (f"{shape['model']} (random weights), {args.refill_requests} requests of lognormal lengths"
            if shape["model"] else f"refill: {args.refill_requests} requests, {PROMPT_TOKENS}-token prompts, "
                                   f"{args.new_tokens} new tokens")
    where = f"{what}; B={args.batch}, k={args.k}, M={args.rounds}, admission {shape['admission']}; {label(backend)}"
    tables = [_boundary_table(boundary, where), _host_table(host, where, backend), _gaps_table(gaps, where)]
    write_results(console, args.json, backend=backend, tables=tables, results=boundary + host + gaps, profile=True,
                  repeats=repeats, pipeline_depths=list(depths), **shape)
    return 0


def _boundary_table(results: list, where: str):
    cols = ["phase"] + [f"depth {r['depth']}: {kind}" for r in results for kind in ("admitting boundary µs",
                                                                                    "plain step µs")]
    table = new_table(f"bench serve --profile: host time of a burst boundary by phase (medians); {where}", cols)
    for phase in BOUNDARY_ROWS:
        cells = []
        for r in results:
            cells += [fmt(r["median_us_per_admitting_boundary"][phase], 1),
                      fmt(r["median_us_per_plain_step"][phase], 1) if phase in PLAIN_ROWS else ""]
        table.add_row(phase, *cells)
    table.add_section()
    # the runs' own figures (medians over the runs): under each depth's first column
    footer = (("slots admitted", lambda r: fmt(r["median_us_per_admitting_boundary"]["slots"], 0)),
              ("admitting boundaries a run", lambda r: str(r["admitting_boundaries_per_run"])),
              ("boundaries a run", lambda r: fmt(r["boundaries"], 0)),
              ("deferred boundaries a run", lambda r: fmt(r["deferred_boundaries"], 0)),
              ("bursts a run", lambda r: fmt(r["bursts"], 0)),
              ("wall ms a run", lambda r: fmt(r["wall_ms"], 1)),
              ("host µs / step", lambda r: fmt(r["host_us_per_step"], 1)),
              ("GPU idle", lambda r: _pct(r["gpu_idle_fraction"])),
              ("admission spans ms", lambda r: fmt(r["gpu_admission_ms"], 2)))
    for name, cell in footer:
        table.add_row(name, *[c for r in results for c in (cell(r), "")])
    return table


def _host_table(results: list, where: str, backend):
    device = "device work left out" if backend.is_gpu else "device work (run on the host by numpy) left out"
    table = new_table(f"bench serve --profile: host µs per step by phase (medians; {device}); {where}",
                      ["depth", "steps", "bursts", "mean host µs / burst", *HOST_COLUMNS])
    for r in results:
        med = r["median_us_per_step"]
        table.add_row(str(r["depth"]), str(r["steps"]), str(r["bursts"]), fmt(r["mean_host_us_per_burst"], 1),
                      *(fmt(med[c], 1) for c in HOST_COLUMNS))
    return table


def _gaps_table(rows: list, where: str):
    table = new_table(f"bench serve --profile: GPU idle by what preceded each launch; {where}",
                      ["depth", "run", "idle", "wall ms", "bursts", "burst µs", "plain: n, µs", "admit: n, µs",
                       "after: n, µs", "plain gap p50 / p90 µs"])
    for r in rows:
        if not r["timed"]:
            table.add_row(str(r["depth"]), str(r["run"]), "-", f"{r['wall_ms']:.2f}", str(r["bursts"]), "-", "-", "-",
                          "-", "no GPU clock")
            continue
        table.add_row(str(r["depth"]), str(r["run"]), f"{r['idle_pct']}%", f"{r['wall_ms']:.2f}", str(r["bursts"]),
                      str(r["burst_us"]), *(f"{r[c][0]}, {r[c][1]:.0f}" for c in GAP_CATEGORIES),
                      f"{r['plain_p50_us']} / {r['plain_p90_us']}")
    return table


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"
