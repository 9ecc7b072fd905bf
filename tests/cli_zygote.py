"""Command-line runs forked from one interpreter that has imported them.

The signal and kill tests (``tests/test_cli_restart.py``,
``tests/test_cli_resume.py``) each need the command line in a process of its
own, to signal or SIGKILL it mid-run. A fresh interpreter imports torch,
nvalchemi and the command line first, about 7 s of CPU each; this module's
process (the zygote, ``python -m tests.cli_zygote``, one per test process)
imports them once and forks a child per run. The child is a process like any
other: it gets the signal, writes its files, exits with the command's status
(interpreter shut-down included); only its imports were done before the fork.
The zygote runs no model before forking (no thread pool is started), so the
child starts from the state a fresh interpreter has after the same imports.

Protocol, one JSON line each way on stdin/stdout: ``{"spawn": {"argv": [...],
"cwd": ..., "env": {...}, "stderr": PATH, "code": SCRIPT}}`` forks a child that
runs ``SCRIPT`` (with ``sys.argv = ["script", *argv]``) and answers ``{"pid":
N}``; ``{"poll": N}`` answers ``{"status": S}``, ``S`` as
``subprocess.Popen.returncode`` (``-signal`` when killed) or ``null`` while the
child runs.
"""

from __future__ import annotations

import json
import os
import sys


def _child(request: dict) -> None:
    """In the forked child: become the run ``request`` asks for (never returns)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(null)
    os.close(err)
    sys.argv = ["script", *request["argv"]]
    # the script ends with sys.exit(...): the child's interpreter shuts down as
    # a fresh one would, with the command's exit status
    code = compile(request["code"], "<slowed command line>", "exec")
    exec(code, {"__name__": "__main__"})  # noqa: S102
    sys.exit(0)


def main() -> None:
    # what every run imports first (a fresh interpreter's start-up, done once)
    import nvalchemi.dynamics  # noqa: F401

    import nvalchemi_ase.cli.calc
    import nvalchemi_ase.cli.main
    import nvalchemi_ase.cli.md
    import nvalchemi_ase.cli.relax  # noqa: F401
    from nvalchemi_ase._quiet import import_quietly

    import_quietly("nvalchemi.models")
    for line in sys.stdin:
        request = json.loads(line)
        if "spawn" in request:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request["spawn"])
            answer: dict[str, int | None] = {"pid": pid}
        else:
            pid, status = os.waitpid(int(request["poll"]), os.WNOHANG)
            answer = {"status": os.waitstatus_to_exitcode(status) if pid else None}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
