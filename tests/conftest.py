"""Shared fixtures: expensive models and calculators are built once per session.

Under pytest-xdist (``make test`` runs ``pytest -n auto``) each worker is its
own session, so a session fixture is built once per worker; and each worker
gets an equal share of the cores for its thread pools (below).
"""

from __future__ import annotations

import os
import tempfile

import pytest


def _share_the_cores_between_workers() -> None:
    """Size every worker's OpenMP/BLAS pools to its share of the cores.

    Two workers on two cores, each with torch's default pool of two threads,
    spend their time waking each other's threads; OpenMP threads that
    busy-wait (libgomp's default) make it worse on a shared machine. Both
    are read when torch and numpy load their thread pools, so this runs
    before either is imported (this module imports neither at the top);
    subprocesses a test starts inherit it. Values the caller set win.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    share = str(max(1, (cores or os.cpu_count() or 1) // workers))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, share)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_share_the_cores_between_workers()

# The throughput probe sizes working batches from timings: the suite keeps to
# memory budgets so that batching is the same on every run and machine
# (tests/test_throughput.py switches it on with fake clocks); subprocesses a
# test starts inherit both settings. Nothing is cached in the user's home.
os.environ.setdefault("NVALCHEMI_ASE_THROUGHPUT_PROBE", "0")
os.environ.setdefault(
    "NVALCHEMI_ASE_CACHE",
    os.path.join(tempfile.gettempdir(), f"nvalchemi_ase_test_cache_{os.getpid()}"),
)


@pytest.hookimpl(trylast=True)  # after xdist has read the groups
def pytest_collection_finish(session):
    """Refuse to run when ``--dist loadgroup`` silently ignores the groups.

    pytest-xdist marks a grouped test by appending ``@group`` to its node id;
    a pytest on which that no longer takes (9.2, pytest-xdist#1386) would
    build every shared module fixture once per worker: slower, and not what
    the fixtures promise. Fails the run with the fix instead.
    """
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            raise pytest.UsageError(
                f"pytest {pytest.__version__} ignores pytest-xdist's groups "
                f"({item.nodeid} has no @group); install the test extras "
                "(pytest<9.2) or run with TEST_WORKERS=0"
            )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    _keep_module_fixtures_on_one_worker(items)
    _start_the_slow_tests_first(items)
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs CUDA (torch.cuda.is_available() is False)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _keep_module_fixtures_on_one_worker(items):
    """Group the tests that use a module- or session-scoped fixture of their file.

    ``--dist loadgroup`` (``make test``) then runs each such file's sharing
    tests on one worker, so an expensive fixture (ASE references, fitted
    models, prepared runs) is built once instead of once per worker. Tests
    that use only function-scoped fixtures or the cheap ones here spread freely.
    """
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        path = item.nodeid.split("::")[0]
        if info is None:
            continue
        for definitions in info.name2fixturedefs.values():
            last = definitions[-1]
            if last.scope != "function" and last.baseid == path:
                item.add_marker(pytest.mark.xdist_group(path))
                break


def _start_the_slow_tests_first(items):
    """Under pytest-xdist, move the tests marked slow to the front (stable).

    xdist hands tests out in collection order as workers free up, so one
    expensive test handed out last sets the wall time while the other worker
    idles; started first, the slow ones are spread and the many short ones
    fill in at the end. Only on workers (``PYTEST_XDIST_WORKER``): in one
    process, reordering across modules would set module fixtures up twice.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture(scope="session")
def lj_calc64():
    from nvalchemi_ase import NVAlchemiCalculator

    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def lj_calc32():
    from nvalchemi_ase import NVAlchemiCalculator

    return NVAlchemiCalculator("lj", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smooth_lj():
    """LJ argon with a C2 switch (float64): energy-conserving MD."""
    from nvalchemi_ase import NVAlchemiCalculator

    return NVAlchemiCalculator("lj", device="cpu", dtype="float64", switch_width=1.5)


@pytest.fixture(scope="session")
def calc_by_dtype(lj_calc64, lj_calc32):
    import torch

    return {torch.float64: lj_calc64, torch.float32: lj_calc32}
