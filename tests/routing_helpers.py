"""Helpers of the routing tests on the CPU (test_routing.py) and the GPU (test_gpu.py)."""
from __future__ import annotations

from collections.abc import Callable

from minference_fx import routing


def calls_that_checked(run_call: Callable[[], None], site: int, calls: int = 12) -> list[int]:
    """Which of ``calls`` calls of ``run_call()`` built the site's index and recorded its decision (a check sets
    the site's count of skipped calls back to 0)."""
    checked = []
    for call in range(calls):
        run_call()
        if routing.ROUTER.states[site].skipped == 0:
            checked.append(call)
    return checked
