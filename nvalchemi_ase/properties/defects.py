"""Point-defect formation energies of many materials at once.

Every material is repeated into a supercell and given its defects (vacancies,
interstitials, substitutions); every defect supercell of every material and
every bulk reference are relaxed together in one in-flight stream
(:func:`nvalchemi_ase.runners.relax`, ions at fixed cell, each structure
leaving the working batch as it converges) or evaluated in batched calls.
Neutral defects, fixed supercell (the dilute limit at the bulk's volume):

    E_f = E_defect − E_bulk − Σ_i n_i μ_i

with ``E_bulk`` the energy of the perfect supercell, ``n_i`` the atoms of
species ``i`` added (+1) or removed (−1) and ``μ_i`` their chemical
potentials (eV/atom). For an elemental bulk the host species' μ defaults to
its bulk energy per atom, so a vacancy costs E_defect − (N − 1)/N · E_bulk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from ase import Atoms
from ase.build import make_supercell
from ase.data import atomic_numbers

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

__all__ = ["DefectResult", "DefectSpec", "defect_formation_energies", "parse_defect"]

#: Fractional grid points per cell vector searched for the largest void.
VOID_GRID = 24


@dataclass(frozen=True)
class DefectSpec:
    """One kind of point defect, as parsed from its string.

    Attributes
    ----------
    kind : str
        ``"vacancy"``, ``"interstitial"`` or ``"substitution"``.
    species : str or None
        Vacancy: the species removed (None: each species of the host);
        interstitial: the species added (None: each species of the host);
        substitution: the species put in.
    host : str or None
        Substitution only: the species replaced (None: each other species).
    """

    kind: str
    species: str | None = None
    host: str | None = None


def parse_defect(text: str) -> DefectSpec:
    """Read a defect string.

    Parameters
    ----------
    text : str
        ``"vacancy"`` (one per species of the host), ``"vacancy:X"``,
        ``"interstitial"`` (a host atom of each species at the largest
        void), ``"interstitial:X"``, ``"substitution:X"`` (X on the first site
        of each other species), ``"substitution:X@Y"`` (X on the first Y
        site).

    Returns
    -------
    DefectSpec
        The parsed defect.

    Raises
    ------
    ValueError
        For an unknown kind or element.
    """
    kind, _, rest = text.strip().partition(":")
    kind = kind.lower()
    species, _, host = rest.partition("@")
    for name in (species, host):
        if name and name not in atomic_numbers:
            raise ValueError(f"defect {text!r}: {name!r} is not a chemical symbol")
    if kind in ("vacancy", "interstitial") and not host:
        return DefectSpec(kind, species or None)
    if kind == "substitution" and species:
        return DefectSpec(kind, species, host or None)
    raise ValueError(
        f"unknown defect {text!r}; use 'vacancy', 'vacancy:X', 'interstitial', "
        "'interstitial:X', 'substitution:X' or 'substitution:X@Y'"
    )


@dataclass
class DefectResult(MaterialResult):
    """Defect formation energies of one material.

    Attributes
    ----------
    defects : list of str
        Each defect's label, shape (n_defects,): ``"V_X"`` (vacancy of X),
        ``"X_i"`` (interstitial X), ``"X_Y"`` (X on a Y site).
    formation_energies : numpy.ndarray, shape (n_defects,)
        E_f, eV.
    defect_energies : numpy.ndarray, shape (n_defects,)
        Energies of the defect supercells, eV.
    bulk_energy : float
        Energy of the perfect supercell, eV.
    bulk_energy_per_atom : float
        The same per atom, eV/atom.
    supercell : numpy.ndarray of int, shape (3, 3)
        Supercell matrix applied to the input cell (rows: new vectors in
        units of the old ones).
    supercell_natoms : int
        Atoms of the perfect supercell.
    chemical_potentials : dict of str to float
        μ of every species added or removed, eV/atom.
    sites : numpy.ndarray, shape (n_defects, 3)
        Cartesian position of each defect (the removed, added or replaced
        atom, before relaxation), Å.
    relax : bool
        Whether the ions were relaxed (at fixed cell).
    relax_bulk : bool
        Whether cell and ions of the bulk were relaxed first.
    relax_steps : numpy.ndarray of int, shape (n_defects,)
        Optimizer steps of each defect supercell (0: already below ``fmax``;
        -1: not relaxed).
    structures : list of ase.Atoms
        The (relaxed) defect supercells, energies attached, with
        ``info["defect"]`` and ``info["formation_energy"]`` (eV); not
        written to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "formation_energies": "eV",
        "defect_energies": "eV",
        "bulk_energy": "eV",
        "bulk_energy_per_atom": "eV/atom",
        "chemical_potentials": "eV/atom",
        "sites": "Å",
    }

    defects: list[str] = field(default_factory=list)
    formation_energies: np.ndarray | None = None
    defect_energies: np.ndarray | None = None
    bulk_energy: float | None = None
    bulk_energy_per_atom: float | None = None
    supercell: np.ndarray | None = None
    supercell_natoms: int | None = None
    chemical_potentials: dict[str, float] = field(default_factory=dict)
    sites: np.ndarray | None = None
    relax: bool = True
    relax_bulk: bool = False
    relax_steps: np.ndarray | None = None
    structures: list[Atoms] = field(
        default_factory=list, repr=False, metadata={"json": False}
    )


@dataclass
class _Defect:
    """One defect supercell: its label, atoms, changes of composition, site."""

    label: str
    atoms: Atoms
    changes: dict[str, int]
    site: np.ndarray


def defect_formation_energies(
    bulks: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    defects: Sequence[str] = ("vacancy",),
    supercell: int | Sequence[int] | Sequence[Sequence[int]] = 2,
    chemical_potentials: Mapping[str, float] | None = None,
    relax: bool = True,
    fmax: float = 0.01,
    steps: int = 1000,
    optimizer: str = "FIRE",
    relax_bulk: bool = False,
    cell_optimizer: str = "FIRE2",
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[DefectResult]:
    """Compute every defect's formation energy, all materials in one stream.

    Parameters
    ----------
    bulks : ase.Atoms or sequence of ase.Atoms
        The bulk materials (periodic in three directions; never modified;
        start from relaxed cells: the supercell keeps the input's volume).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name (``"lj"``, ``"sevennet-0"``), nvalchemi model or calculator.
    defects : sequence of str
        Defects (:func:`parse_defect`): ``"vacancy"``, ``"vacancy:X"``,
        ``"interstitial"``, ``"interstitial:X"``, ``"substitution:X"``,
        ``"substitution:X@Y"``. A vacancy or substitution takes the first
        atom of its species in the supercell (symmetry-inequivalent sites of
        one species are not enumerated); an interstitial goes to the point
        of the input cell farthest from every atom (searched on a
        :data:`VOID_GRID`³ fractional grid, e.g. fcc's octahedral site).
    supercell : int, (3,) ints or (3, 3) ints
        Repeats of the input cell (an int: the same along each vector) or a
        supercell matrix (``ase.build.make_supercell``).
    chemical_potentials : mapping of str to float, optional
        μ per species, eV/atom. Needed for every species added or removed,
        except the host species of an elemental bulk (default: its bulk
        energy per atom).
    relax : bool
        Relax the ions of every defect supercell and bulk reference at fixed
        cell (one in-flight run over every structure of every material) or
        use single points (unrelaxed formation energies).
    fmax : float
        Force threshold of the relaxations, eV/Å.
    steps : int
        Step limit of each structure's relaxation.
    optimizer : str
        Ion optimizer (``FIRE``, ``FIRE2``, ``LBFGS``, ``BFGS``).
    relax_bulk : bool
        Relax cell and ions of every bulk first (``FrechetCellFilter`` with
        ``cell_optimizer``, one batched run) and build the supercells from
        the relaxed cells.
    cell_optimizer : str
        Optimizer of ``relax_bulk`` (``FIRE2``, ``LBFGS``, ``FIRE``, ``BFGS``).
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need.

    Returns
    -------
    list of DefectResult
        One per material, in input order; a failed material has ``error``
        set and None numbers, the others are computed.

    Raises
    ------
    ValueError
        For invalid arguments, or a defect needing a chemical potential that
        was not given (naming the material and species), before any work.

    Notes
    -----
    E_bulk is the input cell's energy (its ions relaxed at fixed cell with
    ``relax``) times the number of cells in the supercell; a vacancy of an
    elemental crystal is then E_defect − (N − 1)/N · E_bulk. Neutral defects
    only; no finite-size or charge corrections.
    """
    check_relaxation(fmax, steps, optimizer)
    specs = [parse_defect(text) for text in defects]
    if not specs:
        raise ValueError("defects is empty: give at least one, e.g. 'vacancy'")
    matrix = _supercell_matrix(supercell)
    potentials = _check_potentials(chemical_potentials)
    if cell_optimizer not in VARIABLE_CELL_OPTIMIZERS:
        raise ValueError(
            f"cell_optimizer must be one of {', '.join(VARIABLE_CELL_OPTIMIZERS)}, "
            f"got {cell_optimizer!r}"
        )
    calc = resolve_calculator(model, device=device, dtype=dtype)
    inputs = materials(bulks)
    ledger = Ledger(len(inputs))
    validate(calc, inputs, ledger, periodic=True)
    # every material's needed chemical potentials are checked before any work
    for index, bulk in enumerate(inputs):
        if ledger.alive(index):
            try:
                cells, _ = _defect_supercells(bulk, matrix, specs)
            except ValueError:
                continue  # fails the material below
            _check_needed_potentials(index, bulk, cells, potentials)
    structures = (
        relax_cells(
            calc,
            inputs,
            ledger,
            fmax=fmax,
            steps=steps,
            optimizer=cell_optimizer,
            memory_budget=memory_budget,
        )
        if relax_bulk
        else inputs
    )
    derived: list[Derived] = []
    rows: dict[int, tuple[int, list[int], list[_Defect], int]] = {}
    for index, bulk in enumerate(structures):
        if not ledger.alive(index):
            continue
        built = ledger.guard(
            index,
            partial(_defect_supercells, bulk, matrix, specs),
            "building the defect supercells",
        )
        if built is None:
            continue
        cells, natoms = built
        reference = len(derived)
        derived.append(Derived(index, bulk.copy(), "bulk reference"))
        defect_rows = []
        for defect in cells:
            defect_rows.append(len(derived))
            derived.append(Derived(index, defect.atoms, f"defect {defect.label}"))
        rows[index] = (reference, defect_rows, cells, natoms)
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
    for index, bulk in enumerate(structures):
        result = DefectResult(
            index=index,
            formula=inputs[index].get_chemical_formula(),
            natoms=len(inputs[index]),
            relax_bulk=relax_bulk,
            relax=relax,
            supercell=matrix.copy(),
        )
        if index in rows:
            reference, defect_rows, cells, natoms = rows[index]
            result.defects = [defect.label for defect in cells]
            if ledger.alive(index):
                per_cell = float(values[reference])
                _fill(
                    result,
                    bulk,
                    per_cell * natoms / len(bulk),
                    natoms,
                    cells,
                    values[defect_rows],
                    potentials,
                    derived,
                    defect_rows,
                )
                result.relax_steps = relax_steps[defect_rows]
        result.error = ledger.errors.get(index)
        out.append(result)
    return out


def _supercell_matrix(
    supercell: int | Sequence[int] | Sequence[Sequence[int]],
) -> np.ndarray:
    values = np.asarray(supercell)
    if values.size == 1:
        values = np.full(3, values.reshape(-1)[0])
    if values.shape == (3,):
        values = np.diag(values)
    if (
        values.shape != (3, 3)
        or not np.all(np.mod(values, 1) == 0)
        or round(np.linalg.det(values)) < 1
    ):
        raise ValueError(
            "supercell must be a positive integer, three of them or a 3x3 "
            f"integer matrix with a positive determinant, got {supercell!r}"
        )
    return values.astype(int)


def _check_potentials(
    chemical_potentials: Mapping[str, float] | None,
) -> dict[str, float]:
    potentials = {}
    for species, value in (chemical_potentials or {}).items():
        if species not in atomic_numbers:
            raise ValueError(
                f"chemical_potentials: {species!r} is not a chemical symbol"
            )
        if not np.isfinite(value):
            raise ValueError(
                f"chemical_potentials[{species!r}] must be finite (eV/atom), "
                f"got {value}"
            )
        potentials[species] = float(value)
    return potentials


def _check_needed_potentials(
    index: int, bulk: Atoms, cells: list[_Defect], potentials: dict[str, float]
) -> None:
    host = set(bulk.get_chemical_symbols())
    elemental = len(host) == 1
    for defect in cells:
        for species in defect.changes:
            if species in potentials or (elemental and species in host):
                continue
            raise ValueError(
                f"material {index} ({bulk.get_chemical_formula()}), defect "
                f"{defect.label}: no chemical potential for {species}; pass "
                f"chemical_potentials={{{species!r}: ...}} in eV/atom"
            )


def _defect_supercells(
    bulk: Atoms, matrix: np.ndarray, specs: list[DefectSpec]
) -> tuple[list[_Defect], int]:
    """Every defect supercell of one material, and the perfect supercell's atoms."""
    perfect = make_supercell(bulk, matrix)
    perfect.calc = None
    symbols = perfect.get_chemical_symbols()
    species = list(dict.fromkeys(bulk.get_chemical_symbols()))
    cells: list[_Defect] = []
    void: np.ndarray | None = None
    for spec in specs:
        if spec.kind == "vacancy":
            for removed in [spec.species] if spec.species else species:
                site = _first_site(symbols, removed, bulk)
                atoms = perfect.copy()
                position = atoms.positions[site].copy()
                del atoms[site]
                cells.append(_Defect(f"V_{removed}", atoms, {removed: -1}, position))
        elif spec.kind == "interstitial":
            if void is None:
                void = largest_void(bulk)
            for added in [spec.species] if spec.species else species:
                atoms = perfect.copy()
                atoms.append(added)
                atoms.positions[-1] = void
                atoms.wrap()
                cells.append(_Defect(f"{added}_i", atoms, {added: 1}, void.copy()))
        else:
            new = str(spec.species)  # a substitution always names it
            hosts = [spec.host] if spec.host else [s for s in species if s != new]
            for replaced in hosts:
                site = _first_site(symbols, replaced, bulk)
                atoms = perfect.copy()
                atoms[site].symbol = new
                position = atoms.positions[site].copy()
                changes = {replaced: -1, new: 1}
                cells.append(_Defect(f"{new}_{replaced}", atoms, changes, position))
    if not cells:
        raise ValueError(
            "no defect applies (every substitution replaces a species by itself)"
        )
    return cells, len(perfect)


def _first_site(symbols: list[str], species: str, bulk: Atoms) -> int:
    try:
        return symbols.index(species)
    except ValueError:
        raise ValueError(
            f"no {species} atom in {bulk.get_chemical_formula()} to remove or replace"
        ) from None


def largest_void(bulk: Atoms, grid: int = VOID_GRID) -> np.ndarray:
    """Find the point of a periodic cell farthest from every atom.

    Parameters
    ----------
    bulk : ase.Atoms
        The cell (periodic in three directions).
    grid : int
        Fractional grid points per cell vector (the search is exact for sites
        on that grid: 24 holds halves, thirds, quarters, sixths and eighths).

    Returns
    -------
    numpy.ndarray, shape (3,)
        Cartesian position in the cell, Å (the first grid point among equals).
    """
    steps = np.arange(grid) / grid
    fractions = np.stack(np.meshgrid(steps, steps, steps, indexing="ij"), -1).reshape(
        -1, 3
    )
    cell = bulk.cell.array
    points = fractions @ cell  # [G, 3]
    shifts = (
        np.stack(np.meshgrid(*(np.arange(-1, 2),) * 3, indexing="ij"), -1).reshape(
            -1, 3
        )
        @ cell
    )  # [27, 3]
    images = (bulk.get_positions(wrap=True)[:, None, :] + shifts[None]).reshape(-1, 3)
    # squared distance of every grid point to every periodic image: [G, 27 N]
    distances = ((points[:, None, :] - images[None]) ** 2).sum(-1)
    nearest = distances.min(axis=1)
    return points[int(np.argmax(nearest))]


def _fill(
    result: DefectResult,
    bulk: Atoms,
    bulk_energy: float,
    natoms: int,
    cells: list[_Defect],
    defect_energies: np.ndarray,
    potentials: dict[str, float],
    derived: list[Derived],
    defect_rows: list[int],
) -> None:
    per_atom = bulk_energy / natoms
    host = set(bulk.get_chemical_symbols())
    used: dict[str, float] = {}
    for defect in cells:
        for species in defect.changes:
            if species in potentials:
                used[species] = potentials[species]
            elif len(host) == 1 and species in host:
                used[species] = per_atom
    formation = np.array(
        [
            energy
            - bulk_energy
            - sum(count * used[species] for species, count in defect.changes.items())
            for defect, energy in zip(cells, defect_energies, strict=True)
        ]
    )
    result.bulk_energy = bulk_energy
    result.bulk_energy_per_atom = per_atom
    result.supercell_natoms = natoms
    result.chemical_potentials = used
    result.defect_energies = np.asarray(defect_energies, dtype=float)
    result.formation_energies = formation
    result.sites = np.array([defect.site for defect in cells])
    result.structures = [
        with_energy(
            derived[k].atoms, energy, defect=defect.label, formation_energy=float(value)
        )
        for k, energy, defect, value in zip(
            defect_rows, defect_energies, cells, formation, strict=True
        )
    ]
