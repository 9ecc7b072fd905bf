"""Several ``python -m benchmarks`` command lines in one interpreter.

``python -m tests.benchmark_launches PLAN FOLDER`` reads ``PLAN`` (JSON: launch
name → the arguments ``python -m benchmarks`` would get) and runs each command
line in turn, in this process, through ``benchmarks/__main__.py`` itself (as
``python -m benchmarks`` does), then writes ``FOLDER/<launch>.json``: the exit
status, the traceback if it raised, and the CPU seconds it took (this process
and the processes it waited for).

:mod:`tests.test_benchmarks` runs every quick launch this way: each fresh
interpreter importing torch, nvalchemi and the models costs 10-20 s of CPU,
more than most quick sections. A launch that fails is recorded and the next one
still runs, so each test fails or passes on its own launch. What one launch
leaves in the process (imported modules, a loaded model) the next may reuse;
none of the sections changes global state without restoring it (thread
counts, default dtype, warning filters are scoped).
"""

from __future__ import annotations

import json
import resource
import runpy
import sys
import traceback
from pathlib import Path


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_launch(argv: list[str]) -> dict[str, object]:
    """Run ``python -m benchmarks *argv`` in this process; its outcome."""
    saved = sys.argv
    sys.argv = ["benchmarks", *argv]
    status: object = 0
    error = ""
    start = _cpu_seconds()
    try:
        runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    except SystemExit as exit:  # benchmarks/__main__.py: raise SystemExit(main())
        status = exit.code
    except BaseException:  # recorded for the test to report
        status = 1
        error = traceback.format_exc()
    finally:
        sys.argv = saved
    return {"status": status, "error": error, "cpu_s": _cpu_seconds() - start}


def main() -> None:
    plan_path, folder = Path(sys.argv[1]), Path(sys.argv[2])
    plan: dict[str, list[str]] = json.loads(plan_path.read_text())
    for launch, argv in plan.items():
        outcome = run_launch(argv)
        (folder / f"{launch}.json").write_text(json.dumps(outcome))
        sys.stderr.write(f"{launch}: exit status {outcome['status']}\n")


if __name__ == "__main__":
    main()
