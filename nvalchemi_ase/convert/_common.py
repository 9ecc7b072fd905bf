"""What the conversion modules share: limits, carried fields, errors, stacked arrays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: ``atom_categories`` value of atoms frozen by ``FixAtoms``
#: (``nvalchemi``'s ``AtomCategory.SPECIAL``, read by ``FreezeAtomsHook``).
FROZEN_CATEGORY = -1


#: Smallest distance, Å, allowed between two atoms, periodic images included.
#: No two nuclei are this close in any molecular or condensed-matter simulation:
#: the shortest bond (H2) is 0.74 Å, and even at megabar pressures interatomic
#: distances stay above about 0.5 Å. A closer pair is almost always a duplicated
#: site (a CIF with partial occupancies read as full sites, a structure pasted
#: twice, a supercell of a cell that already held its images); ASE's own
#: ``ase.geometry.get_duplicate_atoms`` uses the same 0.1 Å by default. Models do
#: not fail loudly on such input: nvalchemi's Lennard-Jones drops a coincident
#: pair (a dimer gets E = 0 eV) and SevenNet-0 returns NaN.
MIN_DISTANCE = 0.1


#: Most periodic images per side, ``ceil((cutoff + skin) / height)``, that the
#: neighbour search may need along a periodic axis (:func:`check_images` with a
#: model). nvalchemi's neighbour list (``nvalchemiops``' ``compute_naive_num_shifts``)
#: visits ``2 n + 1`` images along each axis, and an atom's neighbour count grows
#: like ``n**3``: at 16 a one-atom cubic cell has 17,000 neighbours per atom and
#: builds its list in 0.06 s on two CPU cores, while a cell whose lattice vectors
#: are nearly parallel needs 10**4-10**5 images and does not finish in 15 minutes.
#: Real structures stay far below the limit: the one-atom primitive cell of a
#: close-packed metal (height about 2 Å) with a 12 Å cutoff and a 1 Å skin needs
#: 7, metallic hydrogen at 500 GPa (height about 0.8 Å) with SevenNet-0's 5 Å and
#: a 1 Å skin needs 8.
MAX_PERIODIC_IMAGES = 16


_CARRIED_ARRAYS = frozenset(
    {"numbers", "positions", "momenta", "masses", "initial_charges", "tags"}
)


_CARRIED_INFO = frozenset({"charge", "spin"})


#: Largest atomic number a structure may hold (oganesson). The smallest is 0,
#: ASE's ghost atom ``X`` (mass 1.0 amu in ASE's table); whether a model can
#: evaluate it is the model's business (:func:`check_images` with a model).
MAX_ATOMIC_NUMBER = 118


_ATOM_VECTORS = frozenset({"positions", "velocities", "forces"})


class StructureError(ValueError):
    """A structure cannot be converted; the message names index, field and fix.

    Attributes
    ----------
    index : int
        Position of the offending structure in the input list.
    field : str
        The ASE field at fault (``"positions"``, ``"cell"``, ...).
    """

    def __init__(self, index: int, field: str, problem: str, fix: str) -> None:
        self.index = index
        self.field = field
        super().__init__(f"images[{index}].{field}: {problem}; {fix}")


class NotCarriedWarning(UserWarning):
    """An ``Atoms`` field has no ``Batch`` counterpart and is not carried."""


@dataclass
class _Stacked:
    """All structures' arrays concatenated along atoms (``_v``) or systems (``_b``)."""

    counts_b: npt.NDArray[np.int64]
    numbers_v: npt.NDArray[np.int64]
    positions_v: npt.NDArray[np.float64]
    masses_v: npt.NDArray[np.float64]
    velocities_v: npt.NDArray[np.float64]
    frozen_v: npt.NDArray[np.bool_]
    cell_b: npt.NDArray[np.float64]
    pbc_b: npt.NDArray[np.bool_]
    charges_v: npt.NDArray[np.float64] | None
    tags_v: npt.NDArray[np.int64] | None
    charge_b: npt.NDArray[np.float64] | None
    spin_b: npt.NDArray[np.float64] | None


def _structure_of(atom_index: int, ptr: npt.NDArray[np.int64]) -> tuple[int, int]:
    structure = int(np.searchsorted(ptr, atom_index, side="right") - 1)
    return structure, int(atom_index - ptr[structure])


def _refuse_first_atom(
    bad_v: npt.ArrayLike,
    ptr: npt.NDArray[np.int64],
    field: str,
    problem: Callable[[int], str],
    fix: str,
) -> None:
    """Raise :class:`StructureError` for the first atom flagged in ``bad_v``.

    ``bad_v`` [V] flags atoms of the stacked structures (``ptr`` [B + 1] their
    offsets); the error names the structure and ``field[atom]`` within it.
    ``problem`` is given the flagged atom's stacked index.
    """
    flagged = np.flatnonzero(bad_v)
    if flagged.size:
        first = int(flagged[0])
        structure, atom = _structure_of(first, ptr)
        raise StructureError(structure, f"{field}[{atom}]", problem(first), fix)
