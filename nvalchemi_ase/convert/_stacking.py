"""``Atoms`` -> stacked NumPy arrays, every input validated before any tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from ase import Atoms
from ase.constraints import FixAtoms
from ase.data import atomic_masses as ase_default_masses

from nvalchemi_ase.convert._close_pairs import _check_distances
from nvalchemi_ase.convert._common import (
    MAX_ATOMIC_NUMBER,
    StructureError,
    _refuse_first_atom,
    _Stacked,
)
from nvalchemi_ase.convert._validation import (
    _check_atom_arrays,
    _check_finite_charges,
)
from nvalchemi_ase.units import momenta_to_velocities


def _stack(atoms_list: list[Atoms]) -> _Stacked:
    counts = np.array([len(atoms) for atoms in atoms_list], dtype=np.int64)
    for index in np.flatnonzero(counts == 0):
        raise StructureError(
            int(index),
            "numbers",
            "the structure has no atoms",
            "remove it from the list",
        )
    _check_atom_arrays(atoms_list)
    numbers = np.concatenate([atoms.arrays["numbers"] for atoms in atoms_list])
    positions = np.concatenate([atoms.arrays["positions"] for atoms in atoms_list])
    cell = np.stack([atoms.cell.array for atoms in atoms_list]).astype(np.float64)
    pbc = np.stack([atoms.pbc for atoms in atoms_list]).astype(bool)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    _check_atoms_fields(numbers, positions, ptr)
    _check_cells(cell, pbc)
    masses = _gather_masses(atoms_list, numbers, ptr)
    stacked = _Stacked(
        counts_b=counts,
        numbers_v=numbers.astype(np.int64),
        positions_v=positions.astype(np.float64),
        masses_v=masses,
        velocities_v=_gather_velocities(atoms_list, masses, ptr),
        frozen_v=_gather_frozen(atoms_list, ptr),
        cell_b=cell,
        pbc_b=pbc,
        charges_v=_gather_optional_array(atoms_list, "initial_charges", np.float64),
        tags_v=_gather_optional_array(atoms_list, "tags", np.int64),
        charge_b=_gather_info_number(atoms_list, "charge"),
        spin_b=_gather_info_number(atoms_list, "spin"),
    )
    _check_finite_charges(stacked.charges_v, ptr)
    _check_distances(stacked.positions_v, cell, pbc, ptr)
    return stacked


def _check_atoms_fields(
    numbers: npt.NDArray[Any], positions: npt.NDArray[Any], ptr: npt.NDArray[np.int64]
) -> None:
    _refuse_first_atom(
        ~np.isfinite(positions).all(axis=1),
        ptr,
        "positions",
        lambda bad: f"is not finite ({positions[bad].tolist()})",
        "fix or remove that structure; nothing was computed",
    )
    _refuse_first_atom(
        (numbers < 0) | (numbers > MAX_ATOMIC_NUMBER),
        ptr,
        "numbers",
        lambda bad: f"atomic number {int(numbers[bad])} is outside 0-118",
        "use real elements, or ghost atoms 'X' (0) where the model allows them",
    )


def _check_cells(cell: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]) -> None:
    for index in np.flatnonzero(~np.isfinite(cell).all(axis=(1, 2))):
        raise StructureError(
            int(index), "cell", "contains NaN or inf", "set a finite cell"
        )
    zero_rows = np.linalg.norm(cell, axis=2) == 0.0
    for index, axis in zip(*np.nonzero(zero_rows & pbc), strict=True):
        raise StructureError(
            int(index),
            "cell",
            f"axis {axis} is periodic (pbc[{axis}] is True) but cell vector {axis} "
            "is zero",
            f"set that lattice vector, or make the axis non-periodic "
            f"(atoms.pbc[{axis}] = False) and add vacuum with "
            f"atoms.center(vacuum=10.0, axis={axis})",
        )
    periodic_only = np.where(pbc[:, :, None], cell, 0.0)
    for index in np.flatnonzero(pbc.any(axis=1)):
        rows = periodic_only[index][pbc[index]]
        if np.linalg.matrix_rank(rows, tol=1e-8 * np.abs(rows).max()) < rows.shape[0]:
            raise StructureError(
                int(index),
                "cell",
                f"its periodic lattice vectors are linearly dependent "
                f"({rows.tolist()})",
                "give independent lattice vectors",
            )


def _gather_masses(
    atoms_list: list[Atoms], numbers: npt.NDArray[Any], ptr: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    masses = ase_default_masses[numbers].astype(np.float64)
    for index, atoms in enumerate(atoms_list):
        custom = atoms.arrays.get("masses")
        if custom is not None:
            masses[ptr[index] : ptr[index + 1]] = custom
    _refuse_first_atom(
        ~(masses > 0) | ~np.isfinite(masses),
        ptr,
        "masses",
        lambda bad: f"mass {masses[bad]} is not positive",
        "set positive masses in amu (atoms.set_masses)",
    )
    return masses


def _gather_velocities(
    atoms_list: list[Atoms], masses: npt.NDArray[np.float64], ptr: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    momenta = np.zeros((int(ptr[-1]), 3))
    for index, atoms in enumerate(atoms_list):
        atoms_momenta = atoms.arrays.get("momenta")
        if atoms_momenta is not None:
            momenta[ptr[index] : ptr[index + 1]] = atoms_momenta
    _refuse_first_atom(
        ~np.isfinite(momenta).all(axis=1),
        ptr,
        "momenta",
        lambda bad: "is not finite",
        "fix the momenta or remove them with atoms.set_momenta(None)",
    )
    return momenta_to_velocities(momenta, masses)


def _gather_frozen(
    atoms_list: list[Atoms], ptr: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    frozen = np.zeros(int(ptr[-1]), dtype=bool)
    for index, atoms in enumerate(atoms_list):
        for constraint in atoms.constraints:
            if isinstance(constraint, FixAtoms):
                fixed = _fixed_indices(index, constraint, len(atoms))
                frozen[ptr[index] + fixed] = True
    return frozen


def _fixed_indices(
    index: int, constraint: FixAtoms, count: int
) -> npt.NDArray[np.int64]:
    """Return the indices ``constraint`` freezes in a structure of ``count`` atoms.

    ``FixAtoms`` stores indices (a ``mask=`` is turned into indices when it is
    built); as in NumPy indexing, and so in ASE's ``adjust_positions``, an index
    ``-k`` is the k-th atom from the end of this structure, and an index outside
    ``[-count, count)`` is an error.
    """
    raw = np.asarray(constraint.index)
    if raw.dtype == bool:  # an index attribute overwritten with a mask
        if raw.shape != (count,):
            raise StructureError(
                index,
                "constraints",
                f"FixAtoms holds a mask of {raw.size} entries for {count} atoms",
                "build it as FixAtoms(mask=...) with one entry per atom",
            )
        return np.flatnonzero(raw)
    if raw.size and (raw.ndim != 1 or raw.dtype.kind not in "iu"):
        raise StructureError(
            index,
            "constraints",
            f"FixAtoms indices {raw.tolist()!r} are not integers",
            "give integer atom indices, e.g. FixAtoms(indices=[0, 1])",
        )
    fixed = raw.reshape(-1).astype(np.int64)
    outside = (fixed < -count) | (fixed >= count)
    if outside.any():
        raise StructureError(
            index,
            "constraints",
            f"FixAtoms index {int(fixed[outside][0])} is out of range for a "
            f"structure of {count} atoms",
            f"use indices in [-{count}, {count}) of this structure (negative ones "
            "count from its end); each structure needs its own FixAtoms",
        )
    return fixed % count


def _gather_optional_array(
    atoms_list: list[Atoms], key: str, dtype: type
) -> npt.NDArray[Any] | None:
    if not any(key in atoms.arrays for atoms in atoms_list):
        return None
    values = [
        atoms.arrays[key] if key in atoms.arrays else np.zeros(len(atoms))
        for atoms in atoms_list
    ]
    return np.concatenate(values).astype(dtype)


def _gather_info_number(
    atoms_list: list[Atoms], key: str
) -> npt.NDArray[np.float64] | None:
    if not any(key in atoms.info for atoms in atoms_list):
        return None
    values = np.zeros(len(atoms_list))
    for index, atoms in enumerate(atoms_list):
        value = atoms.info.get(key, 0)
        if isinstance(value, bool | np.bool_ | np.complexfloating) or not isinstance(
            value, int | float | np.number
        ):
            raise StructureError(
                index,
                f'info["{key}"]',
                f"{value!r} is not a number",
                f'set atoms.info["{key}"] to an int',
            )
        if not np.isfinite(value):
            raise StructureError(
                index,
                f'info["{key}"]',
                f"{value!r} is not finite",
                f'set atoms.info["{key}"] to a finite number (an int), or delete it',
            )
        values[index] = value
    return values
