"""XFetch probabilistic early expiration (Vattani, Chierichetti, Lowenstein, VLDB 2015).

A reader refreshes a value early when

    now - delta * beta * ln(rand()) >= expiry

``delta`` is how long the value took to compute, ``beta`` tunes eagerness (1.0 is the
paper's optimum; 0 disables). Since ``-ln(rand())`` is exponentially distributed, the
chance to refresh rises sharply in the last few ``delta`` before expiry: with steady
traffic exactly one reader tends to refresh, shortly before the cliff, and nobody waits.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

__all__ = ["should_refresh_early"]


def should_refresh_early(
    now: float,
    expiry: float,
    delta: float,
    beta: float,
    rand: Callable[[], float] = random.random,
) -> bool:
    if now >= expiry:
        return True
    if beta <= 0 or delta <= 0:
        return False
    # 1 - random() lies in (0, 1]: log() never sees 0.
    return now - delta * beta * math.log(1.0 - rand()) >= expiry
