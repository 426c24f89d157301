"""The server of the open-loop benchmark: ``python -m graphburst.bench.load_server SETTINGS_JSON``.

A child of ``graphburst bench serve --model ... --http`` (its own process, so the load
generator's event loop does not share the server's GIL). It

1. builds the serving loop and warms its prefill (before any request, so no measured run
   pays it): through :class:`~graphburst.serving.factory.ServeConfig` and
   :func:`~graphburst.serving.factory.build_loop` for what ``graphburst serve --model``
   takes (a checkpoint directory, ``tiny-random``), or, for a random-weight shape of
   ``graphburst bench real`` (:data:`graphburst.bench.real_models.MODELS`), its seeded
   random target and draft at acceptance knob ε;
2. draws the check requests (``load_schedule.check_requests``, with the model's
   vocabulary), decodes them through that loop in-process, without HTTP, and prints one
   line, ``graphburst bench: in-process {"vocab": V, "check": [[prompt, max_tokens,
   tokens], ...]}`` (the parent sends the same requests over HTTP and compares, and draws
   its load with that vocabulary);
3. serves the same loop with :func:`graphburst.serving.http.run` on 127.0.0.1, port 0,
   until SIGTERM; that prints ``graphburst serve: listening on http://...``.
"""

from __future__ import annotations

import json
import sys

from rich.console import Console

from ..backend import get_backend
from ..serving.factory import DEVICE_EXIT_FLAGS, ServeConfig, build_loop, describe_warmup, warm_models
from ..serving.request import Request
from ..serving.loop import ServeLoop
from .load_schedule import LengthDist, check_requests

CHECK_PREFIX = "graphburst bench: in-process "
LOOPBACK = "127.0.0.1:0"


def shape_models(name: str, *, batch: int, capacity: int, k: int, dtype: str, eps: float, seed: int, backend,
                 lookup: bool):
    """The random target of ``real_models.MODELS[name]`` and its draft (None with ``lookup``), wrapped for a loop.

    As ``graphburst bench real`` builds them: seeded weights drawn on the device, the
    self-draft (the target's first blocks, shared tensors, its own KV) or the subspace
    draft of a shape of its own, then ε set on the target.
    """
    import torch

    from ..models.checkpoint import wrap_pair
    from ..models.torch_adapter import TorchTarget
    from .real_models import MODELS, Epsilon, instance, random_target, subspace_draft

    spec = MODELS[name]
    device = f"cuda:{backend.device_id}" if backend.is_gpu else "cpu"
    src = random_target(spec, batch=batch, capacity=capacity, kv_slack=k + 2, dtype=getattr(torch, dtype),
                        device=device, seed=seed)
    draft = None if lookup else (instance(src, layers=spec.draft_layers) if spec.draft_cfg is None
                                 else subspace_draft(src, spec, seed=seed))
    Epsilon(src, spec.draft_layers).set(eps)  # after subspace_draft, which rewrites the embeddings and head
    if draft is None:
        return TorchTarget(src, batch=batch, capacity=capacity, backend=backend), None
    return wrap_pair(src, draft, batch=batch, capacity=capacity, backend=backend)


def build(s: dict) -> tuple[ServeLoop, ServeConfig]:
    """The loop and the HTTP server's config of the settings ``s`` (see ``load.server_settings``)."""
    common = dict(backend=s["backend"], batch=s["batch"], k=s["k"], rounds=s["m"], capacity=s["capacity"],
                  max_queue=s["max_queue"], http=LOOPBACK, ngram_min=s["ngram_min"], ngram_max=s["ngram_max"],
                  prefill_chunk=s.get("prefill_chunk"), prefill_warmup=s.get("prefill_warmup"),
                  admission=s.get("admission") or "auto", device_exit=s.get("device_exit") or "off",
                  access_log=s.get("access_log"))
    if s["shape"]:
        from ..models.ngram import NGRAM_DRAFT, ngram_for

        backend = get_backend(s["backend"])
        lookup = s["draft"] == NGRAM_DRAFT
        target, draft = shape_models(s["model"], batch=s["batch"], capacity=s["capacity"], k=s["k"],
                                     dtype=s["dtype"], eps=s["eps"], seed=s["seed"], backend=backend, lookup=lookup)
        if lookup:
            draft = ngram_for(target, n_min=s["ngram_min"], n_max=s["ngram_max"])
        # The server's own settings; the model fields stay unset because the loop is built here.
        common.update(ngram_min=None, ngram_max=None)
        config = ServeConfig(**common, served_model_name=s["served_name"])
        _log(warm_models((target, draft), config.warmup_rows, config.prefill_chunk))  # as build_loop does
        return ServeLoop(target, draft, k=s["k"], m_rounds=s["m"], prefill_chunk=s.get("prefill_chunk"),
                         admission=config.admission, device_exit=DEVICE_EXIT_FLAGS[config.device_exit]), config
    config = ServeConfig(**common, model=s["model"], draft=s["draft"], dtype=s["dtype"])
    return build_loop(config, log=_log), config


def _log(done) -> None:
    """The warm-up's start-up line (a line from build_loop, or warm_models' dict), as serve prints it."""
    if done:
        print(f"graphburst serve: {done if isinstance(done, str) else describe_warmup(done)}", file=sys.stderr,
              flush=True)


def check_in_process(loop: ServeLoop, requests: list) -> list[list[int]]:
    """Tokens of ``[(prompt, max_tokens), ...]`` decoded through ``loop`` directly (no HTTP), one
    request at a time (``load.check_over_http`` sends them so: each is prefilled alone on both sides)."""
    states = []
    for p, n in requests:
        states.append(loop.submit(Request(list(p), int(n))))
        loop.run_until_idle()
    for i, st in enumerate(states):
        if st.error:
            raise RuntimeError(f"check request {i} failed in-process: {st.error}")
    return [st.tokens for st in states]


def main(argv: list[str]) -> int:
    from ..serving import http

    s = json.loads(argv[0])
    try:
        loop, config = build(s)
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as exc:
        print(f"graphburst bench serve: cannot build the server's loop: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 2
    requests = check_requests(s["checks"], prompt=LengthDist(**s["prompt"]), output=LengthDist(**s["output"]),
                              vocab=loop.vocab, seed=s["seed"])
    tokens = check_in_process(loop, requests)
    print(CHECK_PREFIX + json.dumps({"vocab": loop.vocab, "check": [[p, n, t] for (p, n), t in zip(requests, tokens)]}),
          flush=True)
    return http.run(config, Console(stderr=True), loop=loop)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
