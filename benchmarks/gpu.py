"""``python -m benchmarks --suite gpu``: the GPU checks as one prepared run.

Made for a lent GPU machine with little time on it (about 8 minutes on one
GPU). In order, each section started only while the time limit
(``--time-limit``, default 480 s) leaves room for it:

1. the GPU-marked tests (``pytest -m gpu`` over the test files that carry the
   marker): passed, failed, skipped;
2. peak memory against the budget: one working batch sized by the default
   memory budget (:class:`nvalchemi_ase.runners.Budget`), its estimate next to
   the peak measured in a fresh process (``torch.cuda.max_memory_allocated``
   on a GPU, the growth of the resident set on a CPU);
3. layer overhead (``VelocityVerlet``, ``FIRE``) vs nvalchemi driven directly;
4. batched vs sequential (LJ argon MD; SevenNet-0 single points);
5. in-flight relaxation vs fixed chunks vs one by one (LJ, SevenNet-0).

Sections 3-5 are :mod:`benchmarks.run`'s own, at sizes trimmed to the time
limit. One JSON file (every table as data, the environment, the tests' counts,
each section's run time, what was skipped) and one markdown report go into
``--output-dir`` (default ``gpu-report/``). ``--device cpu --quick`` runs the
same code at smoke sizes on a CPU; the test suite does so, so the script
cannot rot while no GPU is lent.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import Report, Settings, environment, settings_for

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

#: Seconds a section is expected to need at the suite's sizes on one GPU; a
#: section starts only while at least this much of the time limit is left.
ROOM_NEEDED = {
    "gpu-tests": 60.0,
    "peak-memory": 60.0,
    "overhead": 60.0,
    "sequential": 90.0,
    "runners": 60.0,
    "runners-sevennet": 90.0,
}
SECTIONS = tuple(ROOM_NEEDED)


@dataclass
class Outcome:
    """What one suite run did, for the JSON report."""

    seconds: dict[str, float]
    skipped: list[str]
    tests: dict[str, int]


def suite_settings(device: str, quick: bool) -> Settings:
    """Sizes of the shared sections: quick on any device, trimmed for a GPU."""
    settings = settings_for(device, quick)
    if quick:
        return settings
    return replace(
        settings,
        repeats=3,
        md_steps=50,
        sizes=(108, 864),
        batch_sizes=(1, 32, 256),
        sevennet_sizes=(16, 64),
    )


# -- 1. GPU-marked tests ---------------------------------------------------------


def gpu_test_files() -> list[str]:
    """Test files that carry the ``gpu`` marker (so only they are collected)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in path.read_text()
    )


def parse_pytest_counts(text: str) -> dict[str, int]:
    """Counts from pytest's closing line (``3 passed, 1 skipped in 2.0s``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    summary = [line for line in text.splitlines() if " in " in line and "=" in line]
    last = summary[-1] if summary else text
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last):
        counts["errors" if word.startswith("error") else word] += int(number)
    return counts


def gpu_tests(report: Report) -> dict[str, int]:
    """Run the GPU-marked tests in a fresh interpreter; add their table."""
    files = gpu_test_files()
    start = time.perf_counter()
    done = subprocess.run(  # noqa: S603 - this repository's own tests
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - start
    counts = parse_pytest_counts(done.stdout)
    report.table(
        "G1. GPU-marked tests",
        ["files", "passed", "failed", "skipped", "errors", "s"],
        [
            [
                str(len(files)),
                *(str(counts[key]) for key in ("passed", "failed", "skipped")),
                str(counts["errors"]),
                f"{seconds:.0f}",
            ]
        ],
        "`pytest -m gpu` over " + ", ".join(f"`{f}`" for f in files) + "; they "
        "skip themselves without CUDA. pytest exit status "
        f"{done.returncode}.",
    )
    return counts


# -- 2. peak memory vs budget ----------------------------------------------------


def _peak_worker(device: str, model: str, count: int) -> None:
    """In a fresh process: fill one batch to the default budget, measure its peak."""
    import torch

    from benchmarks.memory import _structures
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.runners import Budget

    calc = NVAlchemiCalculator(model, device=device, dtype="float32")
    budget = Budget.for_calculator(calc, None, None)
    properties = ["energy", "forces", "stress"]
    warm = next(iter(_structures(1, seed=1)))
    calc.calculate_batch([warm], properties)  # kernels, allocator, model on device
    batch, used = [], None
    for atoms in _structures(count):
        cost = budget.cost(atoms)
        if used is not None and not budget.fits(used, cost):
            break
        batch.append(atoms)
        used = cost if used is None else used + cost
    assert used is not None
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = float(torch.cuda.memory_allocated())
    else:
        baseline = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    start = time.perf_counter()
    calc.calculate_batch(batch, properties)
    if cuda:
        torch.cuda.synchronize()
        peak = float(torch.cuda.max_memory_allocated()) - baseline
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    print(
        json.dumps(
            {
                "structures": len(batch),
                "atoms": float(used[0]),
                "edges": float(used[1]),
                "estimate": float(used[2]),
                "budget": float(budget.max_bytes or 0.0),
                "peak": float(peak),
                "seconds": time.perf_counter() - start,
            }
        )
    )


def peak_memory(settings: Settings, report: Report) -> None:
    """Section G2: the default budget's batch, estimated vs measured memory."""
    import importlib.util

    # quick: LJ (a smoke run; a fresh SevenNet-0 process alone takes ~30 s)
    has_sevenn = importlib.util.find_spec("sevenn") is not None
    model = "sevennet-0" if has_sevenn and not settings.quick else "lj"
    count = 4 if settings.quick else 4096
    command = [sys.executable, "-m", "benchmarks.gpu", "--peak-worker"]
    command += [settings.device, model, str(count)]
    done = subprocess.run(  # noqa: S603 - this repository's module
        command,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
    )
    line = [row for row in done.stdout.splitlines() if row.startswith("{")][-1]
    figures = json.loads(line)
    ratio = figures["peak"] / figures["estimate"] if figures["estimate"] else 0.0
    report.table(
        f"G2. Peak memory vs the memory budget ({model}, float32)",
        [
            "structures",
            "atoms",
            "edges",
            "estimate GiB",
            "measured peak GiB",
            "peak / estimate",
            "budget GiB",
            "s",
        ],
        [
            [
                str(figures["structures"]),
                f"{figures['atoms']:.0f}",
                f"{figures['edges']:.0f}",
                f"{figures['estimate'] / GIB:.3f}",
                f"{figures['peak'] / GIB:.3f}",
                f"{ratio:.2f}",
                f"{figures['budget'] / GIB:.2f}",
                f"{figures['seconds']:.1f}",
            ]
        ],
        "Rattled Si cells of 16-64 atoms added to one batch while the default "
        "budget holds them"
        + (" (4 in quick mode)" if settings.quick else f" (at most {count})")
        + "; energy, forces and stress in one call. Peak: "
        + (
            "`torch.cuda.max_memory_allocated` above the allocation before the call."
            if settings.device.startswith("cuda")
            else "growth of the process's peak resident set during the call "
            "(a CPU measure: allocator caching and the baseline blur it)."
        )
        + " A peak / estimate above 1 means the estimate is not conservative.",
    )


# -- the suite ------------------------------------------------------------------


#: The sections of ``python -m benchmarks`` this suite runs too.
SHARED_SECTIONS = ("overhead", "sequential", "runners", "runners-sevennet")

Section = Callable[[Settings, Report], Any]


def _sections(benchmarks: Mapping[str, Section]) -> dict[str, Section]:
    return {
        "gpu-tests": lambda settings, report: gpu_tests(report),
        "peak-memory": peak_memory,
        **{name: benchmarks[name] for name in SHARED_SECTIONS},
    }


def run_suite(
    device: str,
    quick: bool,
    output_dir: Path,
    time_limit: float,
    benchmarks: Mapping[str, Section],
) -> Outcome:
    """Run every section that fits the time limit; write the JSON and markdown.

    ``benchmarks`` are :data:`benchmarks.run.BENCHMARKS` (passed in, so this
    module does not import the runner that imports it).
    """
    settings = suite_settings(device, quick)
    report = Report()
    outcome = Outcome(seconds={}, skipped=[], tests={})
    start = time.perf_counter()
    for name, section in _sections(benchmarks).items():
        left = time_limit - (time.perf_counter() - start)
        if left < (0.0 if quick else ROOM_NEEDED[name]):
            outcome.skipped.append(name)
            continue
        began = time.perf_counter()
        result = section(settings, report)
        if name == "gpu-tests":
            outcome.tests = result
        outcome.seconds[name] = time.perf_counter() - began
    elapsed = time.perf_counter() - start
    header = environment(settings).replace(
        "Generated by `python -m benchmarks`",
        "Generated by `python -m benchmarks --suite gpu`",
    )
    skipped = ""
    if outcome.skipped:
        names = ", ".join(outcome.skipped)
        skipped = f" Skipped for the time limit ({time_limit:.0f} s): {names}."
    markdown = (
        header
        + f" Total run time {elapsed:.0f} s.{skipped}\n\n"
        + "\n\n".join(report.sections)
        + "\n"
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "gpu-report.md").write_text(markdown)
    payload = {
        "device": device,
        "quick": quick,
        "time_limit_s": time_limit,
        "total_s": elapsed,
        "section_s": outcome.seconds,
        "skipped": outcome.skipped,
        "tests": outcome.tests,
        "environment": header,
        "tables": report.records,
    }
    (output_dir / "gpu-report.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {output_dir / 'gpu-report.md'} and gpu-report.json", file=sys.stderr)
    return outcome


def main() -> None:
    """Entry point of the peak-memory worker (``python -m benchmarks.gpu``)."""
    arguments = sys.argv[1:]
    if arguments[:1] != ["--peak-worker"] or len(arguments) != 4:
        raise SystemExit("run the suite with: python -m benchmarks --suite gpu")
    _peak_worker(arguments[1], arguments[2], int(arguments[3]))


if __name__ == "__main__":
    main()
