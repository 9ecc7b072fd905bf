"""Surface energies of many materials and facets at once.

Every material is cut into one slab per Miller index (``ase.build.surface``:
``layers`` repeats of the bulk cell's surface unit, ``vacuum`` Å on each
side, no periodicity along the normal); every slab of every material and
every bulk reference are relaxed together in one in-flight stream
(:func:`nvalchemi_ase.runners.relax`, ions at fixed cell, each structure
leaving the working batch as it converges) or evaluated in batched calls.
The surface energy of a slab of ``n`` atoms and in-plane area ``A`` (both
faces exposed) is

    γ = (E_slab − n · e_bulk) / (2 A)

with ``e_bulk`` the bulk energy per atom.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from ase import Atoms, units
from ase.build import surface

from nvalchemi_ase.properties._common import (
    VARIABLE_CELL_OPTIMIZERS,
    Derived,
    Ledger,
    MaterialResult,
    materials,
    relax_cells,
    resolve_calculator,
    validate,
)
from nvalchemi_ase.properties._energies import check_relaxation, energies, with_energy

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["EV_PER_A2_TO_J_PER_M2", "SurfaceResult", "build_slab", "surface_energies"]

#: 1 eV/Å² in J/m² (CODATA elementary charge as in ``ase.units``: 16.0218).
EV_PER_A2_TO_J_PER_M2 = units._e * 1e20

#: Default facets (Miller indices of the given cell's lattice).
DEFAULT_MILLER = ((1, 0, 0), (1, 1, 0), (1, 1, 1))


@dataclass
class SurfaceResult(MaterialResult):
    """Surface energies of one material.

    Attributes
    ----------
    miller : numpy.ndarray of int, shape (n_facets, 3)
        Miller indices, of the lattice of the cell that was cut.
    surface_energies : numpy.ndarray, shape (n_facets,)
        γ per facet, eV/Å².
    surface_energies_si : numpy.ndarray, shape (n_facets,)
        γ per facet, J/m².
    slab_energies : numpy.ndarray, shape (n_facets,)
        Slab energies (relaxed with ``relax=True``), eV.
    slab_natoms : numpy.ndarray of int, shape (n_facets,)
        Atoms per slab.
    areas : numpy.ndarray, shape (n_facets,)
        In-plane cell area of each slab (one face), Å².
    bulk_energy_per_atom : float
        Bulk reference energy per atom, eV/atom.
    bulk_energy_given : bool
        Whether it was given (``bulk_energies``) rather than computed.
    relax : bool
        Whether the ions were relaxed (at fixed cell).
    relax_bulk : bool
        Whether cell and ions of the bulk were relaxed before cutting.
    layers : int
        ``ase.build.surface``'s ``layers``.
    vacuum : float
        Vacuum on each side of every slab, Å.
    relax_steps : numpy.ndarray of int, shape (n_facets,)
        Optimizer steps of each slab (0: already below ``fmax``; -1: not
        relaxed).
    slabs : list of ase.Atoms
        The (relaxed) slabs, each with its energy attached
        (``SinglePointCalculator``) and ``info["miller"]``,
        ``info["surface_energy"]`` (eV/Å²); not written to JSON.
    bulk : ase.Atoms or None
        The bulk cell that was cut (relaxed with ``relax_bulk``); not written
        to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "surface_energies": "eV/Å^2",
        "surface_energies_si": "J/m^2",
        "slab_energies": "eV",
        "areas": "Å^2",
        "bulk_energy_per_atom": "eV/atom",
        "vacuum": "Å",
    }

    miller: np.ndarray | None = None
    surface_energies: np.ndarray | None = None
    surface_energies_si: np.ndarray | None = None
    slab_energies: np.ndarray | None = None
    slab_natoms: np.ndarray | None = None
    areas: np.ndarray | None = None
    bulk_energy_per_atom: float | None = None
    bulk_energy_given: bool = False
    relax: bool = True
    relax_bulk: bool = False
    layers: int = 4
    vacuum: float = 10.0
    relax_steps: np.ndarray | None = None
    slabs: list[Atoms] = field(
        default_factory=list, repr=False, metadata={"json": False}
    )
    bulk: Atoms | None = field(default=None, repr=False, metadata={"json": False})


def build_slab(bulk: Atoms, miller: Sequence[int], layers: int, vacuum: float) -> Atoms:
    """Cut one slab with ``ase.build.surface`` (both faces exposed).

    Parameters
    ----------
    bulk : ase.Atoms
        The bulk cell (Miller indices refer to its lattice vectors: pass a
        conventional cell, e.g. ``bulk("Cu", cubic=True)``, for the cubic
        indices).
    miller : sequence of int, length 3
        The facet.
    layers : int
        Repeats of the surface unit along the normal.
    vacuum : float
        Vacuum on each side, Å.

    Returns
    -------
    ase.Atoms
        The slab: in-plane periodic, not periodic along the normal (the third
        cell vector is normal to the surface), atoms wrapped into the cell.
    """
    slab = surface(bulk, tuple(int(i) for i in miller), int(layers), vacuum=vacuum)
    slab.calc = None
    slab.wrap()
    return slab


def surface_energies(
    bulks: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    miller: Sequence[Sequence[int]] = DEFAULT_MILLER,
    layers: int = 4,
    vacuum: float = 10.0,
    relax: bool = True,
    fmax: float = 0.01,
    steps: int = 1000,
    optimizer: str = "FIRE",
    bulk_energies: Sequence[float] | None = None,
    relax_bulk: bool = False,
    cell_optimizer: str = "FIRE2",
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[SurfaceResult]:
    """Surface energy of every facet of every material, all slabs in one stream.

    Parameters
    ----------
    bulks : ase.Atoms or sequence of ase.Atoms
        The bulk materials (periodic in three directions; never modified).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name (``"lj"``, ``"sevennet-0"``), nvalchemi model or calculator.
    miller : sequence of (h, k, l)
        Facets, Miller indices of each bulk cell's lattice (as
        ``ase.build.surface``; the primitive fcc cell's (1, 0, 0) is the cubic
        (1, 1, 1)). Every material gets every facet.
    layers : int
        Repeats of the surface unit along the normal (``ase.build.surface``'s
        ``layers``; the slab keeps the bulk's composition).
    vacuum : float
        Vacuum on each side of every slab, Å (more than the model's cutoff, so
        the faces do not see each other through it).
    relax : bool
        Relax the ions of every slab and of every bulk reference at fixed cell
        (both faces free; one in-flight run over every structure of every
        material) or use single points.
    fmax : float
        Force threshold of the relaxations, eV/Å.
    steps : int
        Step limit of each structure's relaxation.
    optimizer : str
        Ion optimizer (``FIRE``, ``FIRE2``, ``LBFGS``, ``BFGS``).
    bulk_energies : sequence of float, optional
        Bulk reference energy per atom of each material, eV/atom (e.g. from a
        converged bulk calculation); by default the given (or, with
        ``relax_bulk``, relaxed) bulk cell is evaluated, its ions relaxed at
        fixed cell with the slabs when ``relax``.
    relax_bulk : bool
        Relax cell and ions of every bulk first (``FrechetCellFilter`` with
        ``cell_optimizer``, one batched run) and cut the relaxed cells.
    cell_optimizer : str
        Optimizer of ``relax_bulk`` (``FIRE2``, ``LBFGS``, ``FIRE``, ``BFGS``).
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need.

    Returns
    -------
    list of SurfaceResult
        One per material, in input order; a failed material (invalid input,
        a slab or reference that fails or does not converge) has ``error``
        set and None numbers, the others are computed.

    Raises
    ------
    ValueError
        For invalid arguments (before any work).

    Notes
    -----
    γ = (E_slab − n e_bulk) / (2A): the average of the slab's two faces. A
    non-symmetric slab (polar or differently terminated faces) gets the mean
    of its two terminations' energies.
    """
    facets = _check_miller(miller)
    check_relaxation(fmax, steps, optimizer)
    if int(layers) != layers or layers < 1:
        raise ValueError(f"layers must be a positive integer, got {layers}")
    if not vacuum > 0 or not np.isfinite(vacuum):
        raise ValueError(f"vacuum must be positive (Å, each side), got {vacuum}")
    if cell_optimizer not in VARIABLE_CELL_OPTIMIZERS:
        raise ValueError(
            f"cell_optimizer must be one of {', '.join(VARIABLE_CELL_OPTIMIZERS)}, "
            f"got {cell_optimizer!r}"
        )
    calc = resolve_calculator(model, device=device, dtype=dtype)
    structures = materials(bulks)
    given = _check_bulk_energies(bulk_energies, len(structures))
    ledger = Ledger(len(structures))
    validate(calc, structures, ledger, periodic=True)
    references = (
        relax_cells(
            calc,
            structures,
            ledger,
            fmax=fmax,
            steps=steps,
            optimizer=cell_optimizer,
            memory_budget=memory_budget,
        )
        if relax_bulk
        else structures
    )
    derived, slots = _derived(references, facets, int(layers), vacuum, given, ledger)
    values, relax_steps = energies(
        calc,
        derived,
        ledger,
        relax=relax,
        fmax=fmax,
        steps=steps,
        optimizer=optimizer,
        memory_budget=memory_budget,
    )
    out = []
    for index, atoms in enumerate(structures):
        result = SurfaceResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            relax=relax,
            relax_bulk=relax_bulk,
            layers=int(layers),
            vacuum=float(vacuum),
            bulk_energy_given=given is not None,
            miller=np.array(facets, dtype=int),
        )
        if ledger.alive(index):
            bulk_row, slab_rows = slots[index]
            e_bulk = (
                float(given[index])
                if given is not None
                else values[bulk_row] / len(derived[bulk_row].atoms)
            )
            _fill(result, e_bulk, [derived[k] for k in slab_rows], values[slab_rows])
            result.relax_steps = relax_steps[slab_rows]
            result.bulk = references[index].copy()
        result.error = ledger.errors.get(index)
        if result.error is not None:
            _clear(result)
        out.append(result)
    return out


def _check_miller(miller: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    facets = []
    for k, indices in enumerate(miller):
        values = tuple(indices)
        if len(values) != 3 or not all(int(i) == i for i in values) or not any(values):
            raise ValueError(
                f"miller[{k}] must be three integers, not all zero, got {indices!r}"
            )
        facets.append((int(values[0]), int(values[1]), int(values[2])))
    if not facets:
        raise ValueError("miller is empty: give at least one facet, e.g. (1, 1, 1)")
    return facets


def _check_bulk_energies(
    bulk_energies: Sequence[float] | None, count: int
) -> np.ndarray | None:
    if bulk_energies is None:
        return None
    values = np.asarray(bulk_energies, dtype=float).reshape(-1)
    if values.size != count:
        raise ValueError(
            f"bulk_energies has {values.size} values for {count} materials; give "
            "one energy per atom (eV/atom) per material"
        )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(f"bulk_energies[{bad[0]}] is not finite ({values[bad[0]]})")
    return values


def _derived(
    references: list[Atoms],
    facets: list[tuple[int, int, int]],
    layers: int,
    vacuum: float,
    given: np.ndarray | None,
    ledger: Ledger,
) -> tuple[list[Derived], dict[int, tuple[int, list[int]]]]:
    """Bulk reference (unless given) and one slab per facet of every material."""
    derived: list[Derived] = []
    slots: dict[int, tuple[int, list[int]]] = {}
    for index, reference in enumerate(references):
        if not ledger.alive(index):
            continue

        def cut(reference: Atoms = reference) -> list[Atoms]:
            return [build_slab(reference, hkl, layers, vacuum) for hkl in facets]

        slabs = ledger.guard(index, cut, "building the slabs")
        if slabs is None:
            continue
        bulk_row = -1
        if given is None:
            bulk_row = len(derived)
            derived.append(Derived(index, reference.copy(), "bulk reference"))
        rows = []
        for hkl, slab in zip(facets, slabs, strict=True):
            rows.append(len(derived))
            derived.append(Derived(index, slab, f"slab {hkl}"))
        slots[index] = (bulk_row, rows)
    return derived, slots


def _fill(
    result: SurfaceResult,
    e_bulk: float,
    slabs: list[Derived],
    slab_energies: np.ndarray,
) -> None:
    natoms = np.array([len(item.atoms) for item in slabs])
    areas = np.array(
        [
            float(np.linalg.norm(np.cross(item.atoms.cell[0], item.atoms.cell[1])))
            for item in slabs
        ]
    )
    gamma = (slab_energies - natoms * e_bulk) / (2.0 * areas)
    result.bulk_energy_per_atom = e_bulk
    result.slab_energies = np.asarray(slab_energies, dtype=float)
    result.slab_natoms = natoms
    result.areas = areas
    result.surface_energies = gamma
    result.surface_energies_si = gamma * EV_PER_A2_TO_J_PER_M2
    result.slabs = [
        with_energy(
            item.atoms,
            energy,
            miller=np.array(hkl),
            surface_energy=float(value),
        )
        for item, energy, hkl, value in zip(
            slabs, slab_energies, np.asarray(result.miller), gamma, strict=True
        )
    ]


def _clear(result: SurfaceResult) -> None:
    result.surface_energies = result.surface_energies_si = None
    result.slab_energies = result.slab_natoms = result.areas = None
    result.bulk_energy_per_atom = None
    result.relax_steps = None
    result.slabs = []
    result.bulk = None
