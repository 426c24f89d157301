"""What every benchmark shares: the one stub decoder factory, the greedy check that runs
before anything is timed, and the one result writer (rich tables + JSON)."""

from __future__ import annotations

import datetime
import json

import numpy as np
from rich.console import Console
from rich.table import Table

from ..engine.decoder import SpecDecoder
from ..kernels.digest import greedy_reference
from ..models.stubs import stub_pair

VOCAB = 32000
PROMPT_LEN = 8
GPU_LABEL = "GPU timings"
CPU_LABEL = "CPU REFERENCE (numpy backend, not a GPU timing)"


def label(backend) -> str:
    """How every table and JSON file names where its figures come from."""
    return GPU_LABEL if backend.is_gpu else CPU_LABEL


def random_prompts(batch: int, *, length: int = PROMPT_LEN, seed: int = 5) -> list[list[int]]:
    """The benchmark prompts: ``batch`` rows of ``length`` tokens, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(batch)]


def stub_models(backend, *, batch: int, layers=4, capacity: int, accept: float = 0.7, cost_us: float = 0.0,
                seed: int = 11):
    """A stub target (``layers`` KV layers) and a one-layer stub draft: every benchmark's models."""
    return stub_pair(batch, VOCAB, layers, 1, capacity, accept_prob=accept, p_min=0.0, seed=seed,
                     cost_ns=int(cost_us * 1000), backend=backend)


def build_decoder(backend, cfg: dict, capacity: int, prompts=None, **decoder_opts) -> SpecDecoder:
    """The one decoder factory: stub models per ``cfg`` (m, k, batch, layers, accept, cost_us), prefilled.

    ``decoder_opts`` go to :class:`SpecDecoder` as they are (``draft_caps=True``, say).

    ``prompts`` defaults to :func:`random_prompts` for the batch, so every decoder of one
    config starts from the same state.
    """
    target, draft = stub_models(backend, batch=cfg["batch"], layers=cfg["layers"], capacity=capacity,
                                accept=cfg["accept"], cost_us=cfg["cost_us"])
    dec = SpecDecoder(target, draft, k=cfg["k"], m_rounds=cfg["m"], **decoder_opts)
    dec.prefill(random_prompts(cfg["batch"]) if prompts is None else prompts)
    return dec


def check_greedy(what: str, prompts, outs) -> None:
    """Raise AssertionError unless every sequence's tokens continue its prompt greedily.

    Parameters
    ----------
    what : str
        Names the run in the message.
    prompts : list of list of int
    outs : list of list of int
        Tokens per sequence, all bursts concatenated.
    """
    for b, (prompt, out) in enumerate(zip(prompts, outs)):
        if not out:
            raise AssertionError(f"{what}: sequence {b} committed no tokens")
        if list(out) != greedy_reference(prompt, len(out), VOCAB):
            raise AssertionError(f"{what}: sequence {b} differs from the greedy reference")


def int_list(text: str) -> list[int]:
    """A comma list of ints from a flag (``"1,4,16"``); empty items are skipped."""
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    """A comma list of floats from a flag."""
    return [float(x) for x in text.split(",") if x]


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def new_table(title: str, columns) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    return table


def write_results(console: Console, path: str, *, backend, tables, results, **meta) -> None:
    """Print ``tables`` and write ``{"meta": ..., "results": ...}`` to ``path`` as JSON.

    ``meta`` always carries the date, the backend and the CPU/GPU label.
    """
    for table in tables:
        console.print(table)
    meta = dict(date=datetime.date.today().isoformat(), backend=backend.name, label=label(backend), **meta)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    console.print(f"results written to {path}")
