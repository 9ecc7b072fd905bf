"""Batched κ (phono3py) and QHA (phonopy) vs their structure-by-structure loops.

Run from the repository root::

    .venv/bin/python -m benchmarks.thermal [--only kappa|qha] [--repeats 3]

(also ``python -m benchmarks --only kappa`` and ``--only qha``; section 11
of ``docs/performance.md``). Lennard-Jones argon in float64 on the CPU, one
``NVAlchemiCalculator`` shared by both sides:

* ``kappa``: fcc (conventional cell, 32-atom supercell) at three lattice
  constants and hcp (16-atom supercell), RTA on a 4x4x4 mesh at 20 and
  40 K: :func:`nvalchemi_ase.properties.thermal_conductivity` (every
  displaced supercell of every material in batched calls) vs phono3py's
  workflow with ``Atoms.get_forces()`` on one supercell at a time;
* ``qha``: fcc and hcp, 7 volumes, 3x3x3 supercells (27 and 54 atoms),
  0-60 K: :func:`nvalchemi_ase.properties.qha` vs phonopy at each volume
  with one ``get_forces()`` per displaced supercell and ``phonopy.run_qha``.

Both sides skip the relaxation (the inputs are symmetric), so the work is the
same: the forces, phono3py's/phonopy's force constants and their solvers,
which both sides run identically. The table gives both sides' medians, the
ratio and the largest relative difference of their κ or V(T).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from ase import Atoms
from ase.build import bulk

ARGON_A = 5.26  # Å
HCP_A = 3.72  # Å, ideal c/a
KAPPA_MESH = (4, 4, 4)
KAPPA_TEMPERATURES = (20.0, 40.0)
QHA_TEMPERATURES = np.arange(0.0, 71.0, 10.0)
QHA_MESH = (7, 7, 7)
HEADER = [
    "workflow",
    "materials",
    "supercells",
    "batched s",
    "loop s",
    "loop/batched",
    "max rel. diff",
]


def kappa_materials() -> list[Atoms]:
    """Three fcc argon cells and one hcp (all symmetric, no relaxation)."""
    cells = [bulk("Ar", "fcc", a=a, cubic=True) for a in (5.24, ARGON_A, 5.28)]
    return [*cells, bulk("Ar", "hcp", a=HCP_A, c=HCP_A * np.sqrt(8.0 / 3.0))]


def qha_materials() -> list[Atoms]:
    """fcc and hcp argon."""
    return [
        bulk("Ar", "fcc", a=ARGON_A),
        bulk("Ar", "hcp", a=HCP_A, c=HCP_A * np.sqrt(8.0 / 3.0)),
    ]


def _forces_one_by_one(calc: Any, cells: Any) -> np.ndarray:
    out = []
    for cell in cells:
        atoms = Atoms(
            cell.symbols,
            cell=cell.cell,
            scaled_positions=cell.scaled_positions,
            pbc=True,
        )
        atoms.calc = calc
        out.append(atoms.get_forces())
    return np.array(out)


def _unitcell(atoms: Atoms) -> Any:
    from phonopy.structure.atoms import PhonopyAtoms

    return PhonopyAtoms(
        symbols=atoms.get_chemical_symbols(),
        cell=atoms.cell.array,
        scaled_positions=atoms.get_scaled_positions(),
        masses=atoms.get_masses(),
    )


def kappa_loop(calc: Any, materials: list[Atoms]) -> list[np.ndarray]:
    """phono3py's workflow, one supercell at a time: κ (T, 6) per material."""
    from phono3py import Phono3py
    from phonopy.structure.cells import guess_primitive_matrix

    out = []
    for atoms in materials:
        unitcell = _unitcell(atoms)
        ph3 = Phono3py(
            unitcell,
            supercell_matrix=np.diag([2, 2, 2]),
            primitive_matrix=guess_primitive_matrix(unitcell, symprec=1e-5),
        )
        ph3.generate_displacements(distance=0.03)
        ph3.forces = _forces_one_by_one(calc, ph3.supercells_with_displacements)
        ph3.produce_fc3()
        ph3.mesh_numbers = KAPPA_MESH
        ph3.init_phph_interaction()
        ph3.run_thermal_conductivity(temperatures=KAPPA_TEMPERATURES)
        out.append(np.asarray(ph3.thermal_conductivity.kappa)[0])
    return out


def kappa_batched(calc: Any, materials: list[Atoms]) -> list[Any]:
    """All materials through :func:`nvalchemi_ase.properties.thermal_conductivity`."""
    from nvalchemi_ase.properties import thermal_conductivity

    return thermal_conductivity(
        materials, calc, mesh=KAPPA_MESH, temperatures=KAPPA_TEMPERATURES, relax=False
    )


def qha_loop(
    calc: Any, materials: list[Atoms], n_volumes: int, strain: float
) -> list[np.ndarray]:
    """phonopy at every volume, one supercell at a time, then ``run_qha``: V(T)."""
    from phonopy import Phonopy, run_qha
    from phonopy.structure.cells import guess_primitive_matrix

    out = []
    for atoms in materials:
        phonopys, energies = [], []
        for factor in np.linspace(1 - strain, 1 + strain, n_volumes):
            scaled = atoms.copy()
            scaled.set_cell(atoms.cell.array * factor, scale_atoms=True)
            scaled.calc = calc
            energies.append(scaled.get_potential_energy())
            unitcell = _unitcell(scaled)
            phonon = Phonopy(
                unitcell,
                supercell_matrix=np.diag([3, 3, 3]),
                primitive_matrix=guess_primitive_matrix(unitcell, symprec=1e-5),
            )
            phonon.generate_displacements(distance=0.01)
            phonon.forces = _forces_one_by_one(
                calc, phonon.supercells_with_displacements
            )
            phonon.produce_force_constants()
            phonopys.append(phonon)
        cells = len(atoms) // len(phonopys[0].primitive)
        fit = run_qha(
            phonopys,
            QHA_TEMPERATURES,
            internal_energies=np.array(energies) / cells,
            mesh=QHA_MESH,
            exclude_gamma_acoustic=True,
        )
        out.append(np.asarray(fit.equilibrium_volumes) * cells)
    return out


def qha_batched(
    calc: Any, materials: list[Atoms], n_volumes: int, strain: float
) -> list[Any]:
    """All materials through :func:`nvalchemi_ase.properties.qha`."""
    from nvalchemi_ase.properties import qha

    return qha(
        materials,
        calc,
        n_volumes=n_volumes,
        strain=strain,
        supercell=(3, 3, 3),
        mesh=QHA_MESH,
        temperatures=QHA_TEMPERATURES,
        relax_first=False,
        relax=None,
    )


def _smooth_lj() -> Any:
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models import load_model

    model = load_model("lj", cutoff=9.0, switch_width=2.0)
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


def _voigt(tensor: np.ndarray) -> np.ndarray:
    pairs = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))
    return np.stack([tensor[..., i, j] for i, j in pairs], axis=-1)


def kappa_row(repeats: int) -> list[str]:
    """Time both κ sides in alternation; one table row."""
    from benchmarks.harness import interleaved_medians

    calc = _smooth_lj()
    materials = kappa_materials()
    batched: list[Any] = []
    loop: list[np.ndarray] = []
    times = interleaved_medians(
        [
            lambda: batched.__setitem__(slice(None), kappa_batched(calc, materials)),
            lambda: loop.__setitem__(slice(None), kappa_loop(calc, materials)),
        ],
        repeats,
        warmup=1,
    )
    diff = max(
        float(np.max(np.abs(_voigt(r.kappa) - k)) / np.max(np.abs(k)))
        for r, k in zip(batched, loop, strict=True)
    )
    cells = sum(r.n_fc3_displacements for r in batched)
    return _row("kappa (phono3py RTA)", len(materials), cells, times, diff)


def qha_row(repeats: int) -> list[str]:
    """Time both QHA sides in alternation; one table row."""
    from benchmarks.harness import interleaved_medians

    calc = _smooth_lj()
    materials = qha_materials()
    n_volumes, strain = 7, 0.05
    batched: list[Any] = []
    loop: list[np.ndarray] = []
    times = interleaved_medians(
        [
            lambda: batched.__setitem__(
                slice(None), qha_batched(calc, materials, n_volumes, strain)
            ),
            lambda: loop.__setitem__(
                slice(None), qha_loop(calc, materials, n_volumes, strain)
            ),
        ],
        repeats,
        warmup=1,
    )
    diff = max(
        float(np.max(np.abs(r.volume_temperature - v) / v))
        for r, v in zip(batched, loop, strict=True)
    )
    cells = sum(int(r.n_displacements.sum()) for r in batched)
    return _row("qha (phonopy)", len(materials), cells, times, diff)


def _row(
    name: str, count: int, cells: int, times: list[float], diff: float
) -> list[str]:
    batched_s, loop_s = times
    return [
        name,
        str(count),
        str(cells),
        f"{batched_s:.2f}",
        f"{loop_s:.2f}",
        f"{loop_s / batched_s:.2f}",
        f"{diff:.1e}",
    ]


NOTE = (
    "Lennard-Jones argon (cutoff 9 Å, 2 Å switch), float64 on the CPU, one "
    "NVAlchemiCalculator for both sides; no relaxation on either side; median "
    "of {repeats} rounds after one warm-up round, sides timed in alternation. "
    "kappa: fcc at a = 5.24/5.26/5.28 Å (32-atom supercells) and hcp (16), "
    "RTA on a 4x4x4 mesh at 20 and 40 K; qha: fcc and hcp, 7 volumes (±5 % "
    "linear), 3x3x3 supercells, 0-70 K. Both sides run phono3py's/phonopy's "
    "force constants and solvers identically; only the forces differ (batched "
    "calls vs one ASE get_forces per supercell). max rel. diff: largest "
    "|κ_batched - κ_loop| / max|κ| (kappa), |ΔV(T)|/V (qha)."
)


def run(settings: Any, report: Any, which: str) -> None:
    """Section 11 of ``python -m benchmarks`` (``which``: kappa or qha)."""
    import importlib.util

    needed = "phono3py" if which == "kappa" else "phonopy"
    title = f"11. Batched {which} vs the structure-by-structure loop (LJ)"
    if importlib.util.find_spec(needed) is None:
        report.sections.append(f"## {title}\n\n`{needed}` is not installed: skipped.")
        return
    repeats = 1 if settings.quick else settings.repeats
    row = kappa_row(repeats) if which == "kappa" else qha_row(repeats)
    report.table(title, HEADER, [row], NOTE.format(repeats=repeats))


def main(argv: list[str] | None = None) -> int:
    """Run this benchmark alone and print its table."""
    from benchmarks.harness import Report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.thermal")
    parser.add_argument("--only", choices=("kappa", "qha"), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = Report()
    rows = []
    if args.only in (None, "kappa"):
        rows.append(kappa_row(args.repeats))
    if args.only in (None, "qha"):
        rows.append(qha_row(args.repeats))
    report.table(
        "11. Batched kappa/qha vs loops (LJ)",
        HEADER,
        rows,
        NOTE.format(repeats=args.repeats),
    )
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
