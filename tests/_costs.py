"""What the longest tests cost, to start them first under ``make test``.

``tests/conftest.py`` orders pytest-xdist's work units (a group of tests
sharing a module fixture, or one test) longest first, so that no long unit
starts last while the other workers sit idle. The figures only order the
work: a stale or missing one costs wall time, never a result.

``tests/costs.txt`` holds one ``seconds node-id`` line per test that took
:data:`SHORTEST` seconds or more (setup + call + teardown); the others count
0. Refresh it from a run's durations table (any load: only ratios matter)::

    make test PYTEST_ARGS=--durations=0 > durations.log
    python -m tests._costs durations.log > tests/costs.txt

"""

from __future__ import annotations

import functools
import re
import sys
from collections import defaultdict
from pathlib import Path

#: tests under this many seconds are left out of ``tests/costs.txt``
SHORTEST = 3.0
COSTS_FILE = Path(__file__).with_name("costs.txt")
_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")


@functools.cache
def recorded_costs() -> dict[str, float]:
    """Seconds by node id, from ``tests/costs.txt`` (empty if it is missing)."""
    if not COSTS_FILE.is_file():
        return {}
    costs = {}
    for line in COSTS_FILE.read_text(encoding="utf-8").splitlines():
        seconds, _, nodeid = line.partition(" ")
        if nodeid:
            costs[nodeid] = float(seconds)
    return costs


def cost_of(nodeid: str) -> float:
    """Recorded seconds of the test ``nodeid`` (0 when not recorded)."""
    return recorded_costs().get(nodeid.split("@", 1)[0], 0.0)


def costs_from_durations(lines) -> dict[str, float]:
    """Seconds per node id from ``pytest --durations`` lines (phases summed)."""
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        match = _DURATION.match(line)
        if match:
            seconds[match[3].split("@", 1)[0]] += float(match[1])
    return {node: s for node, s in seconds.items() if s >= SHORTEST}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as log:
        table = costs_from_durations(log)
    for node, s in sorted(table.items(), key=lambda entry: -entry[1]):
        print(f"{s:.0f} {node}")  # noqa: T201
