"""TorchSim side by side: the same relaxations and MD runs, ours and TorchSim's.

Our side runs in this process (:func:`nvalchemi_ase.runners.relax` and
:func:`nvalchemi_ase.runners.md`); TorchSim's in a subprocess of its own
interpreter (TorchSim 0.6 needs Python >= 3.12; this project runs on 3.11)
executing :mod:`benchmarks._torchsim_side`, which reads the same structures
from an extxyz file written here and answers with JSON. The interpreter is
``$NVALCHEMI_ASE_TORCHSIM_PYTHON``, by default ``ts-venv/bin/python`` next to
the checkout; without it the section says so in one line and is skipped.

Same work on both sides:

* the structures of :func:`benchmarks.runners.make_structures` (LJ argon,
  4-256 atoms, strained and rattled) and, for SevenNet-0, of
  :func:`benchmarks.sevennet_batched.make_structures` (8-64 atoms, six
  crystals);
* the same model: Lennard-Jones with this package's ``"lj"`` parameters
  (:data:`nvalchemi_ase.models.builtin.ARGON`, hard cutoff, energy not
  shifted: TorchSim's ``LennardJonesModel`` is not shifted either), float64;
  SevenNet-0 (11 Jul 2024) in float32 through ``sevenn.torchsim``;
* FIRE with ASE's parameters (TorchSim ``fire_flavor="ase_fire"``), forces
  only, converged when the largest per-atom force norm is below ``FMAX``
  eV/Å, at most ``STEPS`` steps, in-flight refill within the same atom budget
  (TorchSim's ``InFlightAutoBatcher`` with ``memory_scales_with="n_atoms"``,
  which checks convergence and swaps every ``steps_between_swaps`` steps,
  5 by default; also run checking every step);
* NVE velocity Verlet from the same momenta, fixed steps, same time step,
  binned within the same atom budget.

Before timing, energies and forces of both sides on the inputs are compared
(and after MD, the final positions). Both sides run one thread
(``torch.set_num_threads(1)`` here, ``OMP_NUM_THREADS=1`` there), timed in
alternation round by round after a warm-up round; each side's wall and CPU
time count the whole call, ``Atoms`` in to results out, inside its own
process (interpreter start and imports excluded).

Run alone: ``python -m benchmarks.torchsim [--quick]``, or in the suite:
``python -m benchmarks --only torchsim``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Report, Samples, load_average, ratio_spread

FMAX = 0.05  # eV/Å
STEPS = 1000
TIMESTEP_FS = 2.0
PYTHON_VARIABLE = "NVALCHEMI_ASE_TORCHSIM_PYTHON"
DEFAULT_PYTHON = Path(__file__).resolve().parents[2] / "ts-venv" / "bin" / "python"
SIDE_SCRIPT = Path(__file__).with_name("_torchsim_side.py")
TITLE = "7. TorchSim side by side"
#: SevenNet-0 costs seconds per step per hundred atoms on one CPU thread (both
#: sides): its set keeps to the small cells.
SEVENNET_MAX_SIZE = 16


@dataclass
class Sizes:
    """Work of one run of this benchmark."""

    lj_count: int = 200
    lj_max_atoms: int = 4096
    lj_rounds: int = 3
    md_count: int = 24
    md_steps: int = 100
    md_rounds: int = 3
    warm: int = 10  # structures of the warm-up run (LJ)
    sevennet_count: int = 4
    sevennet_steps: int = 30
    sevennet_md_steps: int = 10
    sevennet_max_atoms: int = 512
    sevennet_rounds: int = 2  # relaxation; MD runs once
    sevennet: bool = True


QUICK = Sizes(
    lj_count=6,
    lj_max_atoms=512,
    lj_rounds=1,
    md_count=3,
    md_steps=5,
    md_rounds=1,
    warm=2,
    sevennet=False,
)


def torchsim_python() -> Path:
    """The interpreter that runs TorchSim's side (it may not exist)."""
    configured = os.environ.get(PYTHON_VARIABLE)
    return Path(configured) if configured else DEFAULT_PYTHON


class TorchSimSide:
    """TorchSim's side: a subprocess answering one JSON line per request."""

    def __init__(self, python: Path) -> None:
        # closed by close(); read back when the subprocess dies
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for variable in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(variable, None)
        try:
            self._process = subprocess.Popen(  # noqa: S603 - this repository's script
                [str(python), str(SIDE_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
                env=env,
            )
        except OSError:
            self._stderr.close()
            raise

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request; its reply, or RuntimeError with TorchSim's words."""
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None
        assert stdout is not None
        try:
            stdin.write(json.dumps({"op": op, **fields}) + "\n")
            stdin.flush()
            line = stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._stderr.seek(0)
            tail = self._stderr.read()[-2000:].strip()
            raise RuntimeError(
                f"TorchSim side exited (code {self._process.poll()}): {tail}"
            )
        reply: dict[str, Any] = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"TorchSim side, {op}: {reply['error']}")
        return reply

    def close(self) -> None:
        """Close its input, wait for it to exit, close the pipes."""
        if self._process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # it died first
                self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._stderr.close()


# -- measurements -------------------------------------------------------------------


def _timed(function: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def _rounds(
    label: str,
    ours: Callable[[int | None], Any],
    theirs: Sequence[Callable[[int | None], dict[str, Any]]],
    rounds: int,
    warm: int,
) -> tuple[list[Samples], Any, list[dict[str, Any]]]:
    """A warm-up on the first ``warm`` structures, then ``rounds`` rounds on all.

    Sides alternate within each round. Every function takes the number of
    structures to run (None: all). Returns the samples (ours first), our last
    result and TorchSim's last replies.
    """
    if warm:
        ours(warm)
        for function in theirs:
            function(warm)
    samples = [Samples() for _ in range(1 + len(theirs))]
    result: Any = None
    replies: list[dict[str, Any]] = [{} for _ in theirs]
    for number in range(rounds):
        wall, cpu, result = _timed(lambda: ours(None))
        samples[0].wall.append(wall)
        samples[0].cpu.append(cpu)
        for position, function in enumerate(theirs):
            replies[position] = function(None)
            samples[position + 1].wall.append(replies[position]["wall"])
            samples[position + 1].cpu.append(replies[position]["cpu"])
        print(
            f"torchsim benchmark: {label} round {number + 1}/{rounds}, wall s: "
            + " / ".join(f"{sample.wall[-1]:.1f}" for sample in samples),
            file=sys.stderr,
            flush=True,
        )
    return samples, result, replies


def _agreement(
    structures: Sequence[Any], calc: Any, side: TorchSimSide
) -> tuple[float, float, float]:
    """Largest relative energy and force differences, and the largest force.

    Forces relative to the largest force component of the set.
    """
    ours = calc.calculate_batch(structures, ["energy", "forces"])
    theirs = side.request("static")
    energy_gap = max(
        abs(mine["energy"] - other) / max(abs(other), 1e-12)
        for mine, other in zip(ours, theirs["energies"], strict=True)
    )
    force_gap = max(
        float(np.abs(mine["forces"] - np.asarray(other)).max())
        for mine, other in zip(ours, theirs["forces"], strict=True)
    )
    largest = max(float(np.abs(mine["forces"]).max()) for mine in ours)
    return energy_gap, force_gap / largest, largest


def _final_check(structures: Sequence[Any], calc: Any, reply: dict[str, Any]) -> str:
    """Our model on TorchSim's final positions: its energies and fmax again?"""
    finals = [atoms.copy() for atoms in structures]
    for atoms, positions in zip(finals, reply["positions"], strict=True):
        atoms.positions = np.asarray(positions)
    values = calc.calculate_batch(finals, ["energy", "forces"])
    energy_gap = max(
        abs(mine["energy"] - other) / max(abs(other), 1e-12)
        for mine, other in zip(values, reply["energies"], strict=True)
    )
    fmax = np.array([np.linalg.norm(v["forces"], axis=1).max() for v in values])
    converged = np.asarray(reply["fmax"]) < FMAX
    return (
        f"our model on its final positions gives its energies to {energy_gap:.1e} "
        f"(relative) and the {int(converged.sum())} it reports converged have "
        f"fmax {fmax[converged].max() if converged.any() else float('nan'):.4f} "
        "eV/Å at most"
    )


def _ase_fire_steps(structures: Sequence[Any], calc: Any, steps: int) -> list[int]:
    """Steps ``ase.optimize.FIRE`` takes on each structure alone (ASE's count)."""
    from ase.optimize import FIRE

    counts = []
    for atoms in structures:
        copy = atoms.copy()
        copy.calc = calc
        optimizer = FIRE(copy, logfile=None)
        optimizer.run(fmax=FMAX, steps=steps)
        counts.append(optimizer.nsteps)
    return counts


def _steps_summary(steps: Sequence[int]) -> str:
    values = np.asarray(steps)
    return (
        f"{int(values.sum())} ({np.median(values):.0f} / "
        f"{np.percentile(values, 90):.0f} / {int(values.max())})"
    )


def _spread(numerator: Sequence[float], denominator: Sequence[float]) -> str:
    """:func:`~benchmarks.run.ratio_spread`, or median and range under 3 rounds."""
    if len(numerator) >= 3:
        return ratio_spread(numerator, denominator)
    ratios = sorted(n / d for n, d in zip(numerator, denominator, strict=True))
    if len(ratios) == 1:
        return f"{ratios[0]:.3f} (one round)"
    return f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})"


def _row(
    label: str, samples: Samples, ours: Samples, extra: Sequence[str]
) -> list[str]:
    same = samples is ours
    return [
        label,
        *extra,
        f"{statistics.median(samples.wall):.2f}",
        f"{statistics.median(samples.cpu):.2f}",
        "1" if same else _spread(samples.wall, ours.wall),
        "1" if same else _spread(samples.cpu, ours.cpu),
    ]


def _write(structures: Sequence[Any], folder: Path, name: str) -> Path:
    from ase.io import write

    path = folder / f"{name}.extxyz"
    write(path, list(structures))
    return path


def relax_case(
    label: str,
    structures: list[Any],
    calc: Any,
    side: TorchSimSide,
    path: Path,
    model: dict[str, Any],
    dtype: str,
    *,
    steps: int,
    max_atoms: int,
    rounds: int,
    warm: int,
    swaps: Sequence[int],
    reference: bool,
) -> tuple[list[list[str]], list[str]]:
    """FIRE relaxation rows and the checks, for one model and structure set.

    TorchSim runs once per entry of ``swaps`` (its ``steps_between_swaps``);
    with ``reference``, ASE's own FIRE runs each structure once, for its step
    counts.
    """
    from nvalchemi_ase.runners import relax

    side.request("load", path=str(path), model=model, dtype=dtype)
    energy_gap, force_gap, largest = _agreement(structures, calc, side)
    checks = [
        f"{label} inputs: energies agree to {energy_gap:.1e} (relative), forces "
        f"to {force_gap:.1e} of the largest force ({largest:.3g} eV/Å)"
    ]

    def ours(count: int | None) -> list[Any]:
        return relax(
            structures[:count],
            calc,
            optimizer="FIRE",
            fmax=FMAX,
            steps=steps,
            max_atoms=max_atoms,
            progress=False,
        )

    def theirs(swap: int) -> Callable[[int | None], dict[str, Any]]:
        def run(count: int | None) -> dict[str, Any]:
            return side.request(
                "relax",
                count=count,
                fmax=FMAX,
                max_steps=steps,
                max_atoms=max_atoms,
                steps_between_swaps=swap,
            )

        return run

    samples, results, replies = _rounds(
        f"{label} relax", ours, [theirs(swap) for swap in swaps], rounds, warm
    )
    our_steps = [int(atoms.info["steps"]) for atoms in results]
    our_energies = np.array([atoms.get_potential_energy() for atoms in results])
    converged = sum(bool(atoms.info["converged"]) for atoms in results)
    rows = [
        _row(
            "nvalchemi_ase `relax` (FIRE)",
            samples[0],
            samples[0],
            [f"{converged}/{len(results)}", _steps_summary(our_steps)],
        )
    ]
    if reference:
        wall, cpu, ase_steps = _timed(lambda: _ase_fire_steps(structures, calc, steps))
        done = sum(count < steps for count in ase_steps)
        rows.append(
            [
                "`ase.optimize.FIRE` one by one (reference, one run)",
                f"{done}/{len(results)}",
                _steps_summary(ase_steps),
                f"{wall:.2f}",
                f"{cpu:.2f}",
                "-",
                "-",
            ]
        )
    names = {
        5: "TorchSim `optimize`, swaps every 5 steps (default)",
        1: "TorchSim, swaps every step",
    }
    for name, sample, reply in zip(
        [names.get(swap, f"TorchSim, swaps every {swap} steps") for swap in swaps],
        samples[1:],
        replies,
        strict=True,
    ):
        done = sum(f < FMAX for f in reply["fmax"])
        rows.append(
            _row(
                name,
                sample,
                samples[0],
                [f"{done}/{len(results)}", _steps_summary(reply["steps"])],
            )
        )
        checks.append(f"{label}, {name}: " + _final_check(structures, calc, reply))
        gap = np.abs(our_energies - np.asarray(reply["energies"]))
        per_atom = gap / np.array([len(atoms) for atoms in structures])
        checks.append(
            f"{label}, final energies ours vs {name}: largest difference "
            f"{1e3 * gap.max():.2g} meV ({1e3 * per_atom.max():.2g} meV/atom)"
        )
    return [[label, *row] for row in rows], checks


def md_case(
    label: str,
    structures: list[Any],
    calc: Any,
    side: TorchSimSide,
    path: Path,
    model: dict[str, Any],
    dtype: str,
    *,
    steps: int,
    max_atoms: int,
    rounds: int,
    warm: int,
) -> tuple[list[list[str]], list[str]]:
    """NVE rows and the check of final positions."""
    from ase import units

    from nvalchemi_ase.runners import md

    side.request("load", path=str(path), model=model, dtype=dtype)

    def ours(count: int | None) -> list[Any]:
        return md(
            structures[:count],
            calc,
            dynamics="VelocityVerlet",
            timestep=TIMESTEP_FS * units.fs,
            steps=steps,
            max_atoms=max_atoms,
        )

    def theirs(count: int | None) -> dict[str, Any]:
        return side.request(
            "md",
            count=count,
            n_steps=steps,
            timestep_ps=TIMESTEP_FS / 1000,
            max_atoms=max_atoms,
        )

    samples, results, replies = _rounds(f"{label} MD", ours, [theirs], rounds, warm)
    gap = max(
        float(np.abs(atoms.positions - np.asarray(other)).max())
        for atoms, other in zip(results, replies[0]["positions"], strict=True)
    )
    atom_steps = sum(len(atoms) for atoms in structures) * steps
    rows = [
        _row(
            name,
            sample,
            samples[0],
            [f"{1e6 * statistics.median(sample.cpu) / atom_steps:.2f}"],
        )
        for name, sample in zip(
            ["nvalchemi_ase `md` (VelocityVerlet)", "TorchSim `integrate` (NVE)"],
            samples,
            strict=True,
        )
    ]
    check = (
        f"{label} NVE, {steps} steps of {TIMESTEP_FS:g} fs: final positions agree "
        f"to {gap:.1e} Å"
    )
    return [[label, *row] for row in rows], [check]


def thermalized(structures: list[Any], temperature_K: float) -> list[Any]:
    """Copies with Maxwell-Boltzmann momenta (seeded per structure)."""
    from benchmarks.harness import thermalized as draw

    return [
        draw(atoms.copy(), temperature_K, seed) for seed, atoms in enumerate(structures)
    ]


def measure(sizes: Sizes, report: Report) -> None:
    """Run both sides and add the section to ``report``."""
    python = torchsim_python()
    if not python.is_file():
        line = (
            f"## {TITLE}\n\nNo TorchSim interpreter at `{python}` (set "
            f"`{PYTHON_VARIABLE}` to a Python >= 3.12 with torch-sim-atomistic, "
            "ase and sevenn): skipped."
        )
        report.sections.append(line)
        print("\n" + line + "\n", flush=True)
        return
    import importlib.util

    import torch

    from benchmarks import runners
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models.builtin import ARGON

    with_sevennet = sizes.sevennet and importlib.util.find_spec("sevenn") is not None
    try:
        side = TorchSimSide(python)
    except OSError as error:  # not executable, not an interpreter
        line = f"## {TITLE}\n\nCannot start `{python}` ({error}): skipped."
        report.sections.append(line)
        print("\n" + line + "\n", flush=True)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    load_before = load_average()
    start = time.perf_counter()
    try:
        versions = side.request("versions")
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            lj = {"name": "lj", **ARGON}
            calc = NVAlchemiCalculator("lj", dtype="float64")
            structures = runners.make_structures(sizes.lj_count)
            rows, checks = relax_case(
                "LJ",
                structures,
                calc,
                side,
                _write(structures, folder, "lj"),
                lj,
                "float64",
                steps=STEPS,
                max_atoms=sizes.lj_max_atoms,
                rounds=sizes.lj_rounds,
                warm=sizes.warm,
                swaps=(5, 1),
                reference=True,
            )
            moving = thermalized(structures[: sizes.md_count], 40.0)
            md_rows, md_checks = md_case(
                "LJ",
                moving,
                calc,
                side,
                _write(moving, folder, "lj_md"),
                lj,
                "float64",
                steps=sizes.md_steps,
                max_atoms=sizes.lj_max_atoms,
                rounds=sizes.md_rounds,
                warm=sizes.warm,
            )
            checks += md_checks
            if with_sevennet:
                from benchmarks import sevennet_batched

                calc = NVAlchemiCalculator("sevennet-0", dtype="float32")
                structures = [
                    atoms
                    for atoms in sevennet_batched.make_structures(
                        4 * sizes.sevennet_count
                    )
                    if len(atoms) <= SEVENNET_MAX_SIZE
                ][: sizes.sevennet_count]
                seven = {"name": "sevennet-0"}
                more, more_checks = relax_case(
                    "SevenNet-0",
                    structures,
                    calc,
                    side,
                    _write(structures, folder, "sevennet"),
                    seven,
                    "float32",
                    steps=sizes.sevennet_steps,
                    max_atoms=sizes.sevennet_max_atoms,
                    rounds=sizes.sevennet_rounds,
                    warm=0,  # the model ran in the agreement check
                    swaps=(5,),
                    reference=False,  # seconds per call: recorded in the docs
                )
                rows += more
                checks += more_checks
                moving = thermalized(structures, 300.0)
                more, more_checks = md_case(
                    "SevenNet-0",
                    moving,
                    calc,
                    side,
                    _write(moving, folder, "sevennet_md"),
                    seven,
                    "float32",
                    steps=sizes.sevennet_md_steps,
                    max_atoms=sizes.sevennet_max_atoms,
                    rounds=1,
                    warm=0,
                )
                md_rows += more
                checks += more_checks
            else:
                checks.append(
                    "SevenNet-0 skipped ("
                    + (
                        "sevenn is not installed here"
                        if sizes.sevennet
                        else "quick run"
                    )
                    + ")"
                )
    except RuntimeError as error:
        line = f"## {TITLE}\n\nTorchSim side failed, skipped: {error}"
        report.sections.append(line)
        print("\n" + line + "\n", flush=True)
        return
    finally:
        side.close()
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - start
    ts_versions = ", ".join(f"{k} {v}" for k, v in versions["versions"].items())
    time_columns = [
        "wall s",
        "CPU s",
        "TorchSim / ours, wall",
        "TorchSim / ours, CPU",
    ]
    seven_limits = f" ({sizes.sevennet_steps} for SevenNet-0)" if with_sevennet else ""
    seven_budget = f", {sizes.sevennet_max_atoms} SevenNet-0" if with_sevennet else ""
    seven_set = (
        f"; SevenNet-0: {sizes.sevennet_count} crystals of at most "
        f"{SEVENNET_MAX_SIZE} atoms, float32 (TorchSim's wrapper always computes "
        f"the stress too), {sizes.sevennet_rounds} round(s) of relaxation and one "
        "of MD after the agreement check (no other warm-up)"
        if with_sevennet
        else ""
    )
    note = (
        f"Ours in this process, TorchSim ({ts_versions}, Python "
        f"{versions['python']}) in a subprocess; one thread each "
        f"(torch threads here {torch.get_num_threads()} outside this section), "
        f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}. FIRE with "
        f"ASE's parameters, forces only, largest per-atom force below {FMAX} "
        f"eV/Å, at most {STEPS} steps{seven_limits}, in-flight refill within the "
        f"same atom budget ({sizes.lj_max_atoms} LJ{seven_budget}). LJ: "
        f"{sizes.lj_count} argon structures of 4-256 atoms, float64, "
        f"{sizes.lj_rounds} round(s) after a warm-up on the first {sizes.warm}"
        f"{seven_set}. Times are each "
        "side's own (Atoms in, results out), sides alternating round by round; "
        "ratios > 1: ours is faster (median of the round-by-round ratios, IQR "
        "and range). Steps: total (median / 90th percentile / largest per "
        f"structure). Load average {load_before} before, {load_average()} after; "
        f"{elapsed:.0f} s in all. Checks: " + "; ".join(checks) + "."
    )
    report.table(
        f"{TITLE}: relaxation",
        ["model", "method", "converged", "steps", *time_columns],
        rows,
        note,
    )
    report.table(
        f"{TITLE}: NVE MD",
        ["model", "method", "CPU µs/atom-step", *time_columns],
        md_rows,
        f"LJ: the first {sizes.md_count} structures of the set above, "
        f"{sizes.md_steps} steps, {sizes.md_rounds} round(s) after a warm-up"
        + (
            f"; SevenNet-0: the {sizes.sevennet_count} structures above, "
            f"{sizes.sevennet_md_steps} steps"
            if with_sevennet
            else ""
        )
        + f"; {TIMESTEP_FS:g} fs, momenta from a seeded Maxwell-Boltzmann draw "
        "(40 K LJ, 300 K SevenNet-0), binned within the atom budgets above.",
    )


def run(settings: Any, report: Any) -> None:
    """Benchmark section for :mod:`benchmarks.run`."""
    if settings.device != "cpu":
        report.sections.append(f"## {TITLE}\n\nCPU only: skipped on {settings.device}.")
        return
    measure(QUICK if settings.quick else Sizes(), report)


def main() -> None:
    """Print the tables (``--quick``: the smoke-test sizes)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as python -m benchmarks
    measure(QUICK if args.quick else Sizes(), Report())


if __name__ == "__main__":
    main()
