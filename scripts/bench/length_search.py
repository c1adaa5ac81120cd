"""The longest input that still fits: doubling until a probe fails, then bisection.

Used by the memory benchmarks (``bench_memory.py``: tokens; ``bench_sp.py``: video frames),
where a probe is one training step that either fits in memory or not.

Example:
    >>> longest(lambda frames: frames <= 37, start=4, step=4, limit=400)
    36
"""

from __future__ import annotations

from collections.abc import Callable


def longest(fits: Callable[[int], bool], start: int, step: int, limit: int) -> int:
    """The longest length for which ``fits`` holds (0 if none): doubling, then bisection to ``step``.

    Assumes memory grows with length, so once a length fails every longer one fails.

    Example:
        >>> longest(lambda frames: frames <= 37, start=4, step=4, limit=400)
        36
    """
    good, bad = 0, None
    length = start
    while length <= limit:
        if not fits(length):
            bad = length
            break
        good, length = length, length * 2
    if bad is None:
        if good < limit and fits(limit):
            return limit
        bad = min(length, limit)
    while bad - good > step:
        middle = (good + bad) // 2 // step * step or step
        if middle <= good:
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
