"""ASE 3.29's own md/optimize/filter tests (and ``test_stress.py``) on this package.

Runs ASE's bundled tests in a subprocess with :mod:`tests.ase_suite.plugin`
(ASE's dynamics classes swapped for this package's, each test's ASE
calculator evaluated through ``NVAlchemiCalculator``), and checks that the
tests that fail are exactly :data:`EXPECTED_FAILURES`: a new failure, or one
that starts to pass, changes this test (and README's count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ase
import pytest

ROOT = Path(__file__).resolve().parents[1]
ASE_TESTS = Path(ase.__file__).parent / "test"
#: What is run: ASE's md, optimize and filter tests, and its LJ stress test.
SUITE = ("md", "optimize", "filter", "test_stress.py")

#: Known limit (README) -> ASE tests it fails, as node ids under ``ase/test``.
EXPECTED_FAILURES = {
    "restart continues the step count": [
        "optimize/test_optimizer_restart.py::test_optimizers_restart[BFGS]",
    ],
    "Langevin has no c1..c5 (BAOAB)": [
        "md/test_langevin_asapcompat.py::test_langevin_asapcompat",
    ],
    "no per-atom stresses": ["md/test_idealgas.py::test_idealgas"],
    "1000-step KL bound holds for ASE's random stream only": [
        "md/test_position_distribution.py::test_position_distribution",
    ],
}


def _node(nodeid: str) -> str:
    return nodeid.split("ase/test/", 1)[-1]


@pytest.fixture(scope="module")
def ase_suite_report(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("ase_suite")
    report = workdir / "report.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["NVALCHEMI_ASE_SUITE_REPORT"] = str(report)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.ase_suite.plugin",
        "-q",
        "-c",
        str(ROOT / "tests" / "ase_suite" / "pytest.ini"),
        "--rootdir",
        str(ASE_TESTS),
        *(str(ASE_TESTS / part) for part in SUITE),
    ]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600
    )
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return {_node(key): value for key, value in json.loads(report.read_text()).items()}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 2.5-11 min measured (two shared cores; ASE alone: ~3 min)
def test_ase_suite_fails_exactly_the_documented_tests(ase_suite_report):
    failed = {
        node
        for node, entry in ase_suite_report.items()
        if entry["outcome"] in ("failed", "error")
    }
    expected = {node for nodes in EXPECTED_FAILURES.values() for node in nodes}
    messages = {node: ase_suite_report[node]["message"] for node in failed - expected}
    assert failed - expected == set(), f"new failures: {messages}"
    assert expected - failed == set(), "now passing: update EXPECTED_FAILURES, README"


@pytest.mark.slow
@pytest.mark.timeout(2400)  # builds the report when run alone
def test_ase_suite_runs_this_package_in_most_tests(ase_suite_report):
    """Scope: tests that construct one of this package's classes (README)."""
    in_scope = [entry for entry in ase_suite_report.values() if entry["used"]]
    passed = [entry for entry in in_scope if entry["outcome"] == "passed"]
    assert len(in_scope) >= 60
    assert len(passed) >= 50
    used = {name for entry in in_scope for name in entry["used"]}
    assert {"VelocityVerlet", "Langevin", "FIRE", "FIRE2", "BFGS", "MDMin"} <= used
