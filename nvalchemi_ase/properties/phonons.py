"""Phonons of many materials at once: phonopy's displacements, batched forces.

phonopy (extra ``nvalchemi-ase[properties]``) builds each material's
supercell and its symmetry-reduced displaced copies; the forces on every
displaced supercell of every material come from batched ``calculate_batch``
calls (as few as the memory budget allows); phonopy then builds the force
constants and the frequencies on a band path and a mesh, and the density of
states. Frequencies are in THz (phonopy's default units for eV, Å and amu);
imaginary frequencies are negative.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from ase import Atoms

from nvalchemi_ase.properties._common import (
    Derived,
    Ledger,
    MaterialResult,
    evaluate,
    materials,
    resolve_calculator,
    validate,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["PhononResult", "phonons", "require_phonopy"]

#: How to install what phonons need.
INSTALL_HINT = (
    "phonons need phonopy and spglib: pip install 'nvalchemi-ase[properties]' "
    "(or pip install phonopy spglib)"
)


@dataclass
class PhononResult(MaterialResult):
    """Phonons of one material (harmonic, finite displacements).

    Attributes
    ----------
    supercell_matrix : numpy.ndarray of int, shape (3, 3)
        Supercell of the input cell used for the force constants.
    displacement : float
        Displacement amplitude, Å.
    n_displacements : int
        Displaced supercells evaluated (after phonopy's symmetry reduction).
    primitive_cell : numpy.ndarray, shape (3, 3)
        phonopy's primitive cell (rows are lattice vectors), Å; q-points are
        in units of its reciprocal lattice.
    force_constants : numpy.ndarray, shape (N_sc, N_sc, 3, 3)
        Second-order force constants of the supercell, eV/Å².
    gamma_frequencies : numpy.ndarray, shape (3 N_prim,)
        Frequencies at Γ, THz (the first three are the acoustic modes, ~0).
    band_path : str or None
        Special points of the band path (ASE notation, ``","`` separates
        disconnected segments); None when no band structure was asked for.
    band_qpoints : numpy.ndarray, shape (Q, 3)
        q-points along the path, reduced coordinates (primitive reciprocal
        lattice, no 2π).
    band_x : numpy.ndarray, shape (Q,)
        Distance along the path, 1/Å (ASE's ``get_linear_kpoint_axis``, no 2π).
    band_special_x : numpy.ndarray, shape (S,)
        Positions of the special points on ``band_x``, 1/Å.
    band_labels : list of str
        Names of the special points (``"G"`` is Γ).
    band_frequencies : numpy.ndarray, shape (Q, 3 N_prim)
        Frequencies along the path, THz.
    mesh : numpy.ndarray of int, shape (3,) or None
        Γ-centred q-mesh for the DOS.
    mesh_qpoints : numpy.ndarray, shape (M, 3)
        Irreducible mesh points, reduced coordinates.
    mesh_weights : numpy.ndarray of int, shape (M,)
        Their multiplicities.
    mesh_frequencies : numpy.ndarray, shape (M, 3 N_prim)
        Frequencies on the mesh, THz.
    dos_frequencies : numpy.ndarray, shape (D,)
        Frequency axis of the DOS, THz.
    dos : numpy.ndarray, shape (D,)
        Total phonon density of states, states/THz per primitive cell.
    phonopy : phonopy.Phonopy
        phonopy's object with the forces and force constants (thermal
        properties, eigenvectors, ``save``); not written to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "displacement": "Å",
        "primitive_cell": "Å",
        "force_constants": "eV/Å^2",
        "gamma_frequencies": "THz",
        "band_x": "1/Å",
        "band_special_x": "1/Å",
        "band_frequencies": "THz",
        "mesh_frequencies": "THz",
        "dos_frequencies": "THz",
        "dos": "states/THz per primitive cell",
    }

    supercell_matrix: np.ndarray | None = None
    displacement: float | None = None
    n_displacements: int | None = None
    primitive_cell: np.ndarray | None = None
    force_constants: np.ndarray | None = None
    gamma_frequencies: np.ndarray | None = None
    band_path: str | None = None
    band_qpoints: np.ndarray | None = None
    band_x: np.ndarray | None = None
    band_special_x: np.ndarray | None = None
    band_labels: list[str] | None = None
    band_frequencies: np.ndarray | None = None
    mesh: np.ndarray | None = None
    mesh_qpoints: np.ndarray | None = None
    mesh_weights: np.ndarray | None = None
    mesh_frequencies: np.ndarray | None = None
    dos_frequencies: np.ndarray | None = None
    dos: np.ndarray | None = None
    phonopy: Any = field(default=None, repr=False, metadata={"json": False})


def require_phonopy() -> None:
    """Raise ImportError naming the extra when phonopy or spglib is missing.

    Raises
    ------
    ImportError
        If ``phonopy`` or ``spglib`` cannot be imported.
    """
    missing = [
        name for name in ("phonopy", "spglib") if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise ImportError(f"{' and '.join(missing)} not installed; {INSTALL_HINT}")


def phonons(
    images: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    supercell: int | Sequence[int] | Sequence[Sequence[int]] = (2, 2, 2),
    displacement: float = 0.01,
    mesh: Sequence[int] | None = (10, 10, 10),
    band_path: str | None = "auto",
    band_npoints: int = 101,
    primitive_matrix: str | Sequence[Sequence[float]] | None = "auto",
    symprec: float = 1e-5,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[PhononResult]:
    """Harmonic phonons of every material, all displaced supercells batched.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The materials (periodic in three directions, relaxed; never modified).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name, nvalchemi model or calculator.
    supercell : int, 3 ints or 3x3 ints
        Supercell of each input cell (diagonal or full matrix).
    displacement : float
        Displacement amplitude, Å.
    mesh : 3 ints or None
        Γ-centred q-mesh for mesh frequencies and the DOS; None: neither.
    band_path : str or None
        ``"auto"``: ASE's default special-point path for the primitive
        cell's Bravais lattice; a string of special points (``"GXWKGL"``);
        None: no band structure.
    band_npoints : int
        q-points along the whole path.
    primitive_matrix : "auto", "P", 3x3 floats or None
        phonopy's primitive cell in terms of the input cell: ``"auto"``
        finds it by symmetry, ``"P"``/None keeps the input cell.
    symprec : float
        Symmetry tolerance, Å (spglib's).
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need (default: half of the memory
        free on the device).

    Returns
    -------
    list of PhononResult
        One per material, in input order; a failed material has ``error``
        set while the others are computed.

    Raises
    ------
    ImportError
        If phonopy or spglib is missing (names the extra to install).
    ValueError
        For invalid arguments.
    """
    require_phonopy()
    if not displacement > 0:
        raise ValueError(f"displacement must be positive (Å), got {displacement}")
    if band_npoints < 2:
        raise ValueError(f"band_npoints must be >= 2, got {band_npoints}")
    if isinstance(primitive_matrix, str) and primitive_matrix not in ("auto", "P"):
        raise ValueError(
            f"primitive_matrix must be 'auto', 'P', None or a 3x3 matrix, got "
            f"{primitive_matrix!r}"
        )
    matrix = _supercell_matrix(supercell)
    mesh_array = None if mesh is None else _mesh(mesh)
    calc = resolve_calculator(model, device=device, dtype=dtype)
    structures = materials(images)
    ledger = Ledger(len(structures))
    objects: dict[int, Any] = {}
    derived: list[Derived] = []
    validate(calc, structures, ledger, periodic=True)
    for index, atoms in enumerate(structures):
        if not ledger.alive(index):
            continue
        phonon = ledger.guard(
            index,
            partial(_displaced, atoms, matrix, displacement, primitive_matrix, symprec),
            "building the displaced supercells (phonopy)",
        )
        if phonon is None:
            continue
        objects[index] = phonon
        supercells = phonon.supercells_with_displacements
        for k, cell in enumerate(supercells):
            label = f"displaced supercell {k + 1}/{len(supercells)}"
            derived.append(Derived(index, _to_ase(cell), label))
    results = evaluate(calc, derived, ["forces"], ledger, memory_budget=memory_budget)
    forces: dict[int, list[np.ndarray]] = {}
    for item, evaluated in zip(derived, results, strict=True):
        if evaluated is not None:
            forces.setdefault(item.material, []).append(evaluated["forces"])
    out = []
    for index, atoms in enumerate(structures):
        result = PhononResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            supercell_matrix=matrix,
            displacement=float(displacement),
        )
        if ledger.alive(index):
            ledger.guard(
                index,
                partial(
                    _post_process,
                    result,
                    objects[index],
                    np.array(forces[index]),
                    mesh_array,
                    band_path,
                    band_npoints,
                ),
                "phonopy's post-processing",
            )
        result.error = ledger.errors.get(index)
        out.append(result)
    return out


def _supercell_matrix(supercell: Any) -> np.ndarray:
    array = np.asarray(supercell)
    if array.ndim == 0:
        array = np.full(3, array)
    if array.shape == (3,):
        array = np.diag(array)
    if array.shape != (3, 3) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"supercell must be an int, 3 ints or a 3x3 int matrix, got {supercell!r}"
        )
    if round(abs(np.linalg.det(array))) < 1:
        raise ValueError(f"supercell matrix {array.tolist()} is singular")
    return array.astype(int)


def _mesh(mesh: Sequence[int]) -> np.ndarray:
    array = np.asarray(mesh)
    if array.shape != (3,) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"mesh must be 3 positive ints, got {mesh!r}")
    if (array < 1).any():
        raise ValueError(f"mesh must be 3 positive ints, got {mesh!r}")
    return array.astype(int)


def _to_phonopy(atoms: Atoms) -> Any:
    from phonopy.structure.atoms import PhonopyAtoms

    return PhonopyAtoms(
        symbols=atoms.get_chemical_symbols(),
        cell=atoms.cell.array,
        scaled_positions=atoms.get_scaled_positions(wrap=False),
        masses=atoms.get_masses(),
    )


def _to_ase(cell: Any) -> Atoms:
    return Atoms(
        symbols=list(cell.symbols),
        cell=np.asarray(cell.cell),
        scaled_positions=np.asarray(cell.scaled_positions),
        masses=np.asarray(cell.masses),
        pbc=True,
    )


def _primitive(unitcell: Any, primitive_matrix: Any, symprec: float) -> np.ndarray:
    """Return phonopy's primitive matrix, resolved here (phonopy 4 warns on "auto")."""
    if primitive_matrix is None or primitive_matrix == "P":
        return np.eye(3)
    if primitive_matrix == "auto":
        from phonopy.structure.cells import guess_primitive_matrix

        return np.asarray(guess_primitive_matrix(unitcell, symprec=symprec))
    return np.asarray(primitive_matrix, dtype=float)


def _displaced(
    atoms: Atoms,
    matrix: np.ndarray,
    displacement: float,
    primitive_matrix: Any,
    symprec: float,
) -> Any:
    from phonopy import Phonopy

    unitcell = _to_phonopy(atoms)
    phonon = Phonopy(
        unitcell,
        supercell_matrix=matrix,
        primitive_matrix=_primitive(unitcell, primitive_matrix, symprec),
        symprec=symprec,
    )
    phonon.generate_displacements(distance=displacement)
    return phonon


def _frequencies(phonon: Any, qpoints: np.ndarray) -> np.ndarray:
    phonon.run_qpoints(qpoints)
    return np.asarray(phonon.qpoints.frequencies)


def _post_process(
    result: PhononResult,
    phonon: Any,
    forces: np.ndarray,
    mesh: np.ndarray | None,
    band_path: str | None,
    band_npoints: int,
) -> None:
    """Force constants, Γ, band and mesh frequencies and the DOS, into ``result``."""
    phonon.forces = forces
    phonon.produce_force_constants()
    result.phonopy = phonon
    result.n_displacements = len(forces)
    result.primitive_cell = np.asarray(phonon.primitive.cell)
    result.force_constants = np.asarray(phonon.force_constants)
    result.gamma_frequencies = _frequencies(phonon, np.zeros((1, 3)))[0]
    if band_path is not None:
        _band(result, phonon, band_path, band_npoints)
    if mesh is not None:
        phonon.run_mesh(mesh, is_gamma_center=True)
        result.mesh = mesh
        result.mesh_qpoints = np.asarray(phonon.mesh.qpoints)
        result.mesh_weights = np.asarray(phonon.mesh.weights)
        result.mesh_frequencies = np.asarray(phonon.mesh.frequencies)
        phonon.run_total_dos()
        result.dos_frequencies = np.asarray(phonon.total_dos.frequency_points)
        result.dos = np.asarray(phonon.total_dos.dos)


def _band(result: PhononResult, phonon: Any, band_path: str, npoints: int) -> None:
    from ase.cell import Cell

    cell = Cell(np.asarray(phonon.primitive.cell))
    path = cell.bandpath(None if band_path == "auto" else band_path, npoints=npoints)
    x, special_x, labels = path.get_linear_kpoint_axis()
    result.band_path = path.path
    result.band_qpoints = np.asarray(path.kpts)
    result.band_x = np.asarray(x)
    result.band_special_x = np.asarray(special_x)
    result.band_labels = list(labels)
    result.band_frequencies = _frequencies(phonon, result.band_qpoints)
