"""The open-loop load of ``graphburst bench serve --model ... --http``: when each request arrives,
how long its prompt is, how many tokens it asks for. Pure numpy, seeded: two runs with
the same settings draw the same schedule.

* **Arrivals**: a Poisson process at ``rate`` requests/s over ``duration`` seconds
  (exponential gaps of mean ``1 / rate``), plus a **burst** of ``burst`` requests that all
  arrive at ``burst_at`` seconds. The arrival stream has its own generator, seeded by
  ``(seed, ARRIVALS)``, so the request contents below do not depend on the rate.
* **Lengths**: prompt and output lengths from a :class:`LengthDist`: ``uniform``
  integers in ``[min, max]``, or ``lognormal`` with the given mean (of the distribution
  before clipping) and shape ``sigma``, rounded and clipped to ``[min, max]``.
* **Prompts**: random token ids in ``[0, vocab)``. Request ``i`` (in arrival order) draws
  its prompt and lengths from its own generator, seeded by ``(seed, REQUESTS, i)``: request
  ``i`` is the same at every rate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

DIST_KINDS = ("uniform", "lognormal")
ARRIVALS, REQUESTS, CHECKS, WARMUP = 0, 1, 2, 3  # the generator streams of one seed


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Token counts drawn per request.

    Parameters
    ----------
    kind : {"uniform", "lognormal"}
    lo, hi : int
        Every draw is in ``[lo, hi]``, ``1 <= lo <= hi``.
    mean : float, optional
        lognormal only: the mean before clipping, in ``[lo, hi]``.
    sigma : float
        lognormal only: the standard deviation of the underlying normal, > 0.
    """

    kind: str
    lo: int
    hi: int
    mean: float | None = None
    sigma: float = 0.5

    def __post_init__(self):
        if self.kind not in DIST_KINDS:
            raise ValueError(f"length distribution must be one of {', '.join(DIST_KINDS)}, got {self.kind!r}")
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"length range must have 1 <= min <= max, got min {self.lo}, max {self.hi}")
        if self.kind == "uniform" and self.mean is not None:
            raise ValueError(f"a uniform length has mean (min + max) / 2; got mean {self.mean} as well")
        if self.kind == "lognormal":
            if self.mean is None or not self.lo <= self.mean <= self.hi:
                raise ValueError(f"a lognormal length needs a mean in [min, max] = [{self.lo}, {self.hi}], "
                                 f"got {self.mean}")
            if not (math.isfinite(self.sigma) and self.sigma > 0):
                raise ValueError(f"lognormal sigma must be a finite number > 0, got {self.sigma}")

    def draw(self, rng: np.random.Generator) -> int:
        """One length."""
        if self.kind == "uniform":
            return int(rng.integers(self.lo, self.hi + 1))
        # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2): mu puts the mean where asked.
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        return int(np.clip(round(float(rng.lognormal(mu, self.sigma))), self.lo, self.hi))

    def describe(self) -> str:
        if self.kind == "uniform":
            return f"uniform [{self.lo}, {self.hi}]"
        return f"lognormal mean {self.mean:g} sigma {self.sigma:g} clipped to [{self.lo}, {self.hi}]"


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request of a schedule: when it is sent (seconds after the run starts) and what it asks."""

    t: float
    prompt: list  # token ids
    max_tokens: int
    burst: bool  # one of the burst's requests


def poisson_times(rng: np.random.Generator, rate: float, duration: float) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate`` per second in ``[0, duration)``, ascending.

    Returns
    -------
    ndarray, [n] float64
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    times, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration:
            return np.asarray(times, dtype=np.float64)
        times.append(t)


def schedule(*, rate: float, duration: float, burst: int = 0, burst_at: float = 0.0, prompt: LengthDist,
             output: LengthDist, vocab: int, seed: int = 0, burst_prompt: LengthDist | None = None) -> list[Arrival]:
    """The requests of one run at ``rate`` requests/s, in arrival order (module docstring).

    Parameters
    ----------
    rate : float
        Poisson arrivals per second, > 0.
    duration : float
        Seconds of Poisson arrivals, > 0.
    burst : int
        Extra requests that all arrive at ``burst_at`` (0: none).
    burst_at : float
        Seconds after the start, in ``[0, duration]``.
    prompt, output : LengthDist
        Prompt lengths and ``max_tokens``.
    vocab : int
        Token ids are in ``[0, vocab)``.
    burst_prompt : LengthDist, optional
        The burst's prompt lengths (default ``prompt``): long prompts arriving at once,
        to see what their prefill does to the streams already decoding.
    """
    if not (duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a finite number > 0, got {duration}")
    if burst < 0:
        raise ValueError(f"burst must be >= 0, got {burst}")
    if burst and not 0 <= burst_at <= duration:
        raise ValueError(f"burst_at must be in [0, duration = {duration}], got {burst_at}")
    poisson = poisson_times(np.random.default_rng([seed, ARRIVALS]), rate, duration)
    times = sorted([(float(t), False) for t in poisson] + [(float(burst_at), True)] * burst)
    return [Arrival(t, *draw_request(i, prompt=burst_prompt if is_burst and burst_prompt else prompt, output=output,
                                     vocab=vocab, seed=seed), is_burst)
            for i, (t, is_burst) in enumerate(times)]


def draw_request(i: int, *, prompt: LengthDist, output: LengthDist, vocab: int, seed: int,
                 stream: int = REQUESTS) -> tuple[list, int]:
    """Request ``i``'s prompt (token ids) and ``max_tokens``, from its own generator ``(seed, stream, i)``."""
    rng = np.random.default_rng([seed, stream, i])
    n_prompt, n_out = prompt.draw(rng), output.draw(rng)
    return rng.integers(0, vocab, n_prompt).tolist(), n_out


def check_requests(n: int, *, prompt: LengthDist, output: LengthDist, vocab: int, seed: int) -> list[tuple]:
    """The correctness check's ``n`` requests ``(prompt, max_tokens)``: drawn like the load's, from their own stream."""
    return [draw_request(i, prompt=prompt, output=output, vocab=vocab, seed=seed, stream=CHECKS) for i in range(n)]


def warmup(n: int, *, prompt: LengthDist, output: LengthDist, vocab: int, seed: int) -> list[Arrival]:
    """``n`` untimed requests, all at time 0, drawn like the load's from their own stream."""
    return [Arrival(0.0, *draw_request(i, prompt=prompt, output=output, vocab=vocab, seed=seed, stream=WARMUP), False)
            for i in range(n)]
