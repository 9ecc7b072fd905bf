"""The benchmark suite's quick mode runs end to end and reports every figure.

Speed is not asserted here (timed tests on shared machines are noise); this
checks that ``python -m benchmarks --quick`` works and its report is complete.
Every benchmark runs, in a few launches (``--only``): SevenNet-0's, the models'
and torchrun's, the others, and the GPU suite's run on the CPU. The launches
are the command lines a user types, each checked by its own test; one
interpreter runs them all in turn (:mod:`tests.benchmark_launches`, through
``benchmarks/__main__.py``), since a fresh one per launch, importing torch,
nvalchemi and the models, costs more CPU than most quick sections.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import BENCHMARKS, GROUPS, expand_names

ROOT = Path(__file__).parents[1]
# the sections a benchmark's report must hold
SECTIONS = {
    "overhead": ["1. Layer overhead"],
    "sequential": ["2a. Batched vs ASE sequential", "2b. SevenNet-0"],
    "calculator": ["3. Calculator overhead"],
    "adapter": ["4. Adapter throughput"],
    "scaling": ["5. Scaling"],
    "neb": ["6. NEB: many paths"],
    "neb-sevennet": ["6b. NEB on SevenNet-0"],
    "properties": ["9a. Batched property workflows"],
    "properties-sevennet": ["9b. Batched property workflows"],
    "models": ["12. Models: batched vs each model's own ASE calculator"],
    "surfaces-defects": [
        "Workflows: surface and defect energies, batched vs the ASE loop (LJ"
    ],
    "md-analysis": ["12. MD analysis: per-structure RDF and MSD"],
    "runners": ["10. In-flight relaxation vs fixed chunks vs one by one (LJ"],
    "runners-sevennet": ["10b. In-flight relaxation vs fixed chunks"],
}
# the GPU suite runs these at the quick sizes too (on the CPU here, in
# test_gpu_suite_runs_end_to_end_on_the_cpu): they are not launched twice
IN_THE_GPU_SUITE = ["overhead", "sequential", "runners", "runners-sevennet"]
# the launches (command lines of ``python -m benchmarks``): SevenNet-0's, the
# models' and torchrun's, the others; all run by one interpreter (above)
LAUNCHES = {
    "sevennet": ["neb-sevennet", "memory", "properties-sevennet"],
    "models-torchrun": ["models", "distributed"],
}
LAUNCHES["others"] = [
    name
    for name in BENCHMARKS
    if name not in IN_THE_GPU_SUITE
    and all(name not in run for run in LAUNCHES.values())
]


def _assert_complete(text: str, names: list[str]) -> None:
    """Every section of ``names`` is in the report, its speed-ups positive."""
    for name in names:
        for section in SECTIONS.get(name, []):
            assert f"## {section}" in text, section
    speedups = [float(x) for x in re.findall(r"\| ([0-9.]+)× \|", text)]
    if any(name in SECTIONS for name in names):
        assert speedups
    assert all(0 < value < 1e4 for value in speedups)


def test_the_launches_run_every_benchmark_once():
    launched = [name for names in LAUNCHES.values() for name in names]
    assert sorted(launched + IN_THE_GPU_SUITE) == sorted(BENCHMARKS)
    assert set(SECTIONS) <= set(BENCHMARKS)


def test_groups_name_benchmarks_and_expand_in_order_once():
    for members in GROUPS.values():
        assert set(members) <= set(BENCHMARKS)
    assert expand_names(["qha", "workflows", "scaling"]) == [
        "qha",
        "surfaces-defects",
        "kappa",
        "md-analysis",
        "scaling",
    ]


#: the GPU suite's command line, the last launch (``--output-dir`` added)
GPU_SUITE = ["--suite", "gpu", "--device", "cpu", "--quick"]


@pytest.fixture(scope="module")
def quick_launches(tmp_path_factory) -> Path:
    """Every launch run by one interpreter; the folder of their outcomes.

    ``FOLDER/<launch>.json`` holds each launch's exit status and traceback (a
    failed launch does not stop the next), ``FOLDER/<launch>.md`` its report,
    ``FOLDER/gpu/`` the GPU suite's.
    """
    folder = tmp_path_factory.mktemp("benchmarks")
    plan = {
        launch: ["--quick", "--only", *names, "--output", str(folder / f"{launch}.md")]
        for launch, names in LAUNCHES.items()
    }
    plan["gpu"] = [*GPU_SUITE, "--output-dir", str(folder / "gpu")]
    (folder / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.benchmark_launches",
            str(folder / "plan.json"),
            str(folder),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
        check=False,
    )
    (folder / "stderr.txt").write_text(done.stderr)
    return folder


def _launched(folder: Path, launch: str) -> None:
    """Fail unless ``launch`` ran to exit status 0 (with its traceback if not)."""
    outcome = folder / f"{launch}.json"
    assert outcome.exists(), (folder / "stderr.txt").read_text()[-3000:]
    result = json.loads(outcome.read_text())
    assert result["status"] == 0, result["error"][-3000:]


# the launches run one after another: minutes on a loaded 2-core CPU, in the
# set-up of whichever of these tests runs first
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_quick_benchmark_writes_a_complete_report(launch, quick_launches):
    names = LAUNCHES[launch]
    _launched(quick_launches, launch)
    text = (quick_launches / f"{launch}.md").read_text()
    assert "quick (smoke test" in text
    _assert_complete(text, names)
    if "scaling" in names:
        assert re.search(r"log-log slope: \*\*-?[0-9.]+\*\*", text)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_gpu_suite_runs_end_to_end_on_the_cpu(quick_launches):
    """``--suite gpu --device cpu --quick``: every section, one JSON, one report."""
    _launched(quick_launches, "gpu")
    folder = quick_launches / "gpu"
    payload = json.loads((folder / "gpu-report.json").read_text())
    assert payload["skipped"] == []
    assert set(payload["section_s"]) == {"gpu-tests", "peak-memory", *IN_THE_GPU_SUITE}
    # without CUDA every GPU-marked test skips itself, none fails
    assert payload["tests"]["skipped"] >= 2
    assert payload["tests"]["failed"] == payload["tests"]["errors"] == 0
    titles = [table["title"] for table in payload["tables"]]
    assert any(title.startswith("G1. GPU-marked tests") for title in titles)
    (peak,) = [t for t in payload["tables"] if t["title"].startswith("G2.")]
    structures, atoms, *_ = peak["rows"][0]
    assert int(structures) == 4
    assert float(atoms) > 0
    text = (folder / "gpu-report.md").read_text()
    assert "--suite gpu" in text
    _assert_complete(text, IN_THE_GPU_SUITE)


def test_pytest_counts_are_read_from_the_closing_line():
    from benchmarks.gpu import parse_pytest_counts

    text = "ss.F\nSKIPPED [2] needs CUDA\n== 1 failed, 1 passed, 2 skipped in 3.1s =="
    assert parse_pytest_counts(text) == {
        "passed": 1,
        "failed": 1,
        "skipped": 2,
        "errors": 0,
    }
    assert parse_pytest_counts("2 skipped in 0.5s")["skipped"] == 2
