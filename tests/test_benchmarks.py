"""The benchmark suite's quick mode runs end to end and reports every figure.

Speed is not asserted here (timed tests on shared machines are noise); this
checks that ``python -m benchmarks --quick`` works and its report is complete.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SECTIONS = [
    "1. Layer overhead",
    "2a. Batched vs ASE sequential",
    "3. Calculator overhead",
    "4. Adapter throughput",
    "5. Scaling",
    "6. NEB: many paths",
    "6b. NEB on SevenNet-0",
    "9a. Batched property workflows",
    "9b. Batched property workflows",
    "Workflows: surface and defect energies, batched vs the ASE loop (LJ",
]


@pytest.mark.slow
def test_quick_benchmark_writes_a_complete_report(tmp_path):
    report = tmp_path / "performance.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--output", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert "quick (smoke test" in text
    for section in SECTIONS:
        assert f"## {section}" in text, section
    speedups = [float(x) for x in re.findall(r"\| ([0-9.]+)× \|", text)]
    assert speedups
    assert all(0 < value < 1e4 for value in speedups)
    assert re.search(r"log-log slope: \*\*-?[0-9.]+\*\*", text)
