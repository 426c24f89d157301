"""Numpy twin of the device-exit burst's condition kernel (``kernels/round_exit.cu``).

Same name and signature as its wrapper in ``round_exit_cuda.py``; updates ``state`` in place.
"""

from __future__ import annotations

import numpy as np

from ..constants import (
    EXIT_ACK,
    EXIT_BY_FLAG,
    EXIT_BY_IDLE,
    EXIT_BY_ROUNDS,
    EXIT_GO,
    EXIT_REASON,
    EXIT_ROUNDS,
    EXIT_RUNNING,
)


def round_exit(budget, state, stop_count, *, m_max, begin, hold=False, handle=0, stream=None):
    """Decide at a round boundary whether the burst runs another round.

    The count of rounds becomes 0 (``begin``, before the first round) or grows by one. The
    loop goes on while the count is below ``m_max``, some slot has budget left and the host's
    stop count equals the one last answered; when it ends, ``ack`` becomes the stop count read
    (every stop request made before this boundary is answered), unless ``hold``: then requests
    stay pending until the host answers them (:meth:`RoundExit.answer`).

    Parameters
    ----------
    budget : [B] int32
    state : [EXIT_WORDS] int32, updated: ``[rounds, go, ack, reason]``
    stop_count : [1] int32
        The host's stop-request count (mapped pinned memory on cupy).
    m_max : int
        Rounds a burst runs at most.
    begin : bool
    hold : bool
        Leave ``ack`` alone when the loop ends (stop requests held until answered).
    handle : int
        The WHILE node's conditional handle on cupy (set to ``go``); ignored here.
    """
    rounds = 0 if begin else int(state[EXIT_ROUNDS]) + 1
    requested = int(stop_count[0])
    if requested != int(state[EXIT_ACK]):
        reason = EXIT_BY_FLAG
    elif not np.any(budget > 0):
        reason = EXIT_BY_IDLE
    elif rounds >= m_max:
        reason = EXIT_BY_ROUNDS
    else:
        reason = EXIT_RUNNING
    go = int(reason == EXIT_RUNNING)
    state[EXIT_ROUNDS] = rounds
    state[EXIT_GO] = go
    state[EXIT_REASON] = reason
    if not go and not hold:
        state[EXIT_ACK] = requested
