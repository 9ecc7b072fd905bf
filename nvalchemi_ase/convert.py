"""Lossless conversion between lists of ASE ``Atoms`` and an nvalchemi ``Batch``.

nvalchemi 0.3 offers ``AtomicData.from_atoms`` one structure at a time; it drops
momenta, tags, constraints and initial charges, refuses molecules mixed with
periodic systems, slabs without a third cell vector and left-handed cells, and
has no way back. This module builds the whole ``Batch`` in one vectorised pass
(the per-structure work is gathering arrays; there is no per-atom Python loop),
and converts back, field by field:

=========================  ==========================  ===============================
ASE                        Batch field (level, shape)  notes
=========================  ==========================  ===============================
``positions``              ``positions`` (atoms,       Å, not wrapped
                           [V, 3])
``numbers``                ``atomic_numbers`` (atoms,  int32 as ``from_atoms``; 1-118
                           [V])
``cell``                   ``cell`` (system,           rows are lattice vectors in both
                           [B, 3, 3])                  codes; left-handed cells kept
zero cell vectors on       ``cell`` padding rows and   a non-periodic axis with a zero
non-periodic axes          ``cell_padding`` (system,   vector (molecule, slab) gets an
                           [B, 3] bool)                orthogonal stand-in vector so
                                                       every cell is invertible; it is
                                                       zero again on the way back
``pbc``                    ``pbc`` (system, [B, 3])    per structure, mixed in a batch
``get_masses()``           ``atomic_masses`` (atoms,   amu; custom isotopes kept, the
                           [V])                        ``masses`` array is restored only
                                                       where it differs from ASE's
                                                       defaults
``momenta``                ``velocities`` (atoms,      Å/ASE-time = momenta / masses
                           [V, 3])                     (nvalchemi's velocity unit);
                                                       zeros when absent
``initial_charges``        ``charges`` (atoms, [V])    e; present when any structure
                                                       has them (others 0)
``info["charge"]``         ``charge`` (system, [B,1])  e; present when any structure
                                                       has it (others 0)
``info["spin"]``           ``spin`` (system, [B, 1])   as given; present when any
                                                       structure has it (others 0)
``tags``                   ``tags`` (atoms, [V])       int64; present when any has tags
``FixAtoms``               ``atom_categories`` = -1    (atoms, [V] int64) nvalchemi's
                                                       frozen-atom marker read by
                                                       ``FreezeAtomsHook``; 0 otherwise
results: energy, forces,   ``energy`` [B, 1],          only :func:`batch_to_atoms` /
stress                     ``forces`` [V, 3],          :func:`update_atoms` read them,
                           ``stress`` [B, 3, 3]        into a ``SinglePointCalculator``
                                                       (stress as Voigt, only for cells
                                                       of rank 3)
other ``info`` /           not carried                 warned once per key
``arrays`` keys, other                                 (:class:`NotCarriedWarning`)
constraints
=========================  ==========================  ===============================

The user's ``Atoms`` are never modified by :func:`atoms_to_batch`; every input is
validated before any tensor is built, and a bad structure raises
:class:`StructureError` naming its index, the field and the fix. Besides single
fields this includes ``FixAtoms`` indices resolved per structure with ASE's rules
and atoms closer than :data:`MIN_DISTANCE` (periodic images included);
:func:`check_images` with a model also checks the model's elements and that no
periodic cell is too thin for its cutoff (:data:`MAX_PERIODIC_IMAGES`).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixAtoms
from ase.data import atomic_masses as ase_default_masses
from ase.data import chemical_symbols

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.devices import DtypeLike, resolve_device, resolve_dtype
from nvalchemi_ase.units import (
    momenta_to_velocities,
    stress_3x3_to_voigt,
    velocities_to_momenta,
)

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = [
    "FROZEN_CATEGORY",
    "MAX_ATOMIC_NUMBER",
    "MAX_PERIODIC_IMAGES",
    "MIN_DISTANCE",
    "NotCarriedWarning",
    "StructureError",
    "as_atoms_list",
    "atoms_to_batch",
    "batch_field",
    "batch_results",
    "batch_to_atoms",
    "check_images",
    "refresh_positions",
    "update_atoms",
]

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
#: Largest atomic number a structure may hold (oganesson).
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


def as_atoms_list(images: Atoms | Iterable[Atoms]) -> list[Atoms]:
    """Return ``images`` as a list of ``Atoms`` (one ``Atoms`` becomes a 1-list).

    Parameters
    ----------
    images : ase.Atoms or iterable of ase.Atoms
        One structure or several.

    Returns
    -------
    list of ase.Atoms
        The same objects (not copies).

    Raises
    ------
    TypeError
        If an element is not an ``ase.Atoms`` (its index is named).
    ValueError
        If the list is empty.
    """
    atoms_list = [images] if isinstance(images, Atoms) else list(images)
    if not atoms_list:
        raise ValueError("images is empty; pass at least one ase.Atoms")
    for index, atoms in enumerate(atoms_list):
        if not isinstance(atoms, Atoms):
            hint = (
                "; cell filters (FrechetCellFilter, UnitCellFilter) are accepted "
                "by nvalchemi_ase.optimize, not by the adapter"
                if hasattr(atoms, "atoms")
                else ""
            )
            raise TypeError(
                f"images[{index}] is a {type(atoms).__name__}, not an ase.Atoms{hint}"
            )
    return atoms_list


def check_images(
    images: Atoms | Sequence[Atoms], *, model: Any = None, skin: float = 0.0
) -> None:
    """Validate structures before any work, as :func:`atoms_to_batch` does, and more.

    Without a model this runs exactly the checks of :func:`atoms_to_batch`
    (nothing is built): at least one atom; atomic numbers 1-118; finite
    positions, cell, momenta and charges; positive masses; per-atom arrays of
    one row per atom and a numeric dtype; a lattice vector on every periodic
    axis; ``FixAtoms`` indices inside the structure (negative ones count from
    its end, as ASE's); finite numeric ``info["charge"]``/``info["spin"]``; no
    two atoms, or an atom and a periodic image of any atom (itself included),
    closer than :data:`MIN_DISTANCE`. With a model it also checks

    * the elements against the model's (``model.supported_elements``, see
      :func:`nvalchemi_ase.models.supported_elements`);
    * that no periodic axis is so thin against ``cutoff + skin`` (the model's
      ``model_config.neighbor_config.cutoff``) that the neighbour search would
      need more than :data:`MAX_PERIODIC_IMAGES` images per side.

    The structures are never modified.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The structures.
    model : BaseModelMixin, optional
        The nvalchemi model the structures are meant for.
    skin : float
        Verlet skin, Å, added to the model's cutoff (a dynamics object's
        ``neighbor_skin``; 0 for single evaluations).

    Raises
    ------
    StructureError
        For the first structure that cannot be simulated (index, field, fix).
    TypeError, ValueError
        For an ``images`` that is not ``Atoms``, an empty list, or a bad ``skin``.
    """
    skin = _check_skin(skin)
    stacked = _stack(as_atoms_list(images))
    if model is not None:
        _check_model_fit(stacked, model, skin)


def atoms_to_batch(
    images: Atoms | Sequence[Atoms],
    *,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    warn_dropped: bool = True,
) -> Batch:
    """Convert one ``Atoms`` or a list of them into one nvalchemi ``Batch``.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        B structures of any sizes; molecules, slabs and bulk may be mixed.
    device : torch.device or str or None
        Where the batch lives; ``None`` means CUDA when available, else CPU.
    dtype : torch.dtype or str or None
        Floating dtype of positions, cell, masses, velocities and charges;
        ``None`` means ``torch.float64`` (lossless).
    warn_dropped : bool
        Emit a :class:`NotCarriedWarning` for ``info``/``arrays`` keys and
        constraints that the batch cannot carry (once per key and calling
        line: Python's warnings registry, under the default action).

    Returns
    -------
    nvalchemi.data.Batch
        B graphs with V atoms in all; the fields are listed in this module's
        docstring. No neighbour list is built.

    Raises
    ------
    StructureError
        For a structure that cannot be simulated (empty, non-finite positions or
        cell, unknown element, periodic axis without a lattice vector, atoms
        closer than :data:`MIN_DISTANCE`, ...; see :func:`check_images`), before
        any tensor is built.
    """
    atoms_list = as_atoms_list(images)
    stacked = _stack(atoms_list)
    if warn_dropped:
        _warn_not_carried(atoms_list)
    return _build_batch(stacked, resolve_device(device), resolve_dtype(dtype))


def refresh_positions(batch: Batch, images: Atoms | Sequence[Atoms]) -> None:
    """Write new positions and cells of the same structures into an existing batch.

    Much cheaper than :func:`atoms_to_batch` when only geometry changed (ASE's
    usual calculator call); every other field of the batch is kept. Stand-in
    cell vectors of non-periodic axes are recomputed for the new positions, as
    :func:`atoms_to_batch` would.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        Built by :func:`atoms_to_batch` from structures with the same atom
        counts, elements and periodicity as ``images``.
    images : ase.Atoms or sequence of ase.Atoms
        The structures with their new positions (Å) and cells (Å).

    Raises
    ------
    StructureError
        For non-finite positions or cells, or a periodic axis without a lattice
        vector, before anything is written.

    Notes
    -----
    The distance and model checks of :func:`check_images` are not repeated
    here (this is the cheap path); ``NVAlchemiCalculator`` runs
    :func:`check_images` before every evaluation.
    """
    atoms_list = as_atoms_list(images)
    counts = np.array([len(atoms) for atoms in atoms_list], dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    numbers = np.concatenate([atoms.arrays["numbers"] for atoms in atoms_list])
    positions = np.concatenate([atoms.arrays["positions"] for atoms in atoms_list])
    cell = np.stack([atoms.cell.array for atoms in atoms_list]).astype(np.float64)
    pbc = np.stack([atoms.pbc for atoms in atoms_list]).astype(bool)
    _check_atoms_fields(numbers, positions, ptr)
    _check_cells(cell, pbc)
    padded_cell, _ = _padded_cells(cell, pbc, positions, ptr)
    with torch.no_grad():
        batch.positions.copy_(torch.from_numpy(positions))
        batch.cell.copy_(torch.from_numpy(padded_cell))


def batch_to_atoms(batch: Batch) -> list[Atoms]:
    """Convert a ``Batch`` back into a list of new ``Atoms``.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        B graphs, e.g. from :func:`atoms_to_batch` or a dynamics run.

    Returns
    -------
    list of ase.Atoms
        B new structures carrying every field in this module's table. When the
        batch holds ``energy``/``forces``/``stress`` they are attached as a
        ``SinglePointCalculator`` (stress in Voigt order, eV/Å³, for cells of
        rank 3 only).
    """
    host = _HostCopy(batch)
    results = _results_from_host(host)
    images = []
    for index in range(host.num_graphs):
        atoms = Atoms(
            numbers=host.split("atomic_numbers", index),
            positions=host.split("positions", index),
            cell=host.cell(index),
            pbc=host.system("pbc", index),
        )
        _restore_optional_fields(atoms, host, index)
        if results[index]:
            atoms.calc = SinglePointCalculator(atoms, **results[index])
        images.append(atoms)
    return images


def update_atoms(
    images: Atoms | Sequence[Atoms],
    batch: Batch,
    *,
    results: bool = True,
    momenta: bool | npt.NDArray[np.bool_] = True,
    stress: bool = True,
    rotation: npt.NDArray[np.float64] | None = None,
    positions: bool | npt.NDArray[np.bool_] = True,
    only: Sequence[int] | npt.NDArray[np.intp] | None = None,
) -> None:
    """Write a batch's state back into existing ``Atoms``, in place.

    Positions, momenta (velocities times the Atoms' own masses) and the cell
    (only its non-padding rows, so variable-cell runs come back) are written.
    With ``results=True`` the batch's energy, forces and stress become the
    structure's calculator results, so ``atoms.get_potential_energy()`` costs no
    model call: a calculator offering ``store_results(atoms, results)`` (such as
    ``NVAlchemiCalculator``) has its cache primed, ``None`` or a
    ``SinglePointCalculator`` is replaced by a new ``SinglePointCalculator``, and
    any other calculator is left alone.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The B structures the batch was built from, in the same order.
    batch : nvalchemi.data.Batch
        B graphs with the same atom counts.
    results : bool
        Also store energy/forces/stress as described above.
    momenta : bool or numpy.ndarray, shape (B,), bool
        Write momenta from the batch's velocities (False when the velocities
        are an optimizer's internal state rather than physical); an array
        chooses per structure.
    stress : bool
        Include the batch's stress in the results (False when it is stale).
    rotation : numpy.ndarray, shape (B, 3, 3), optional
        Orthogonal matrices R with which the batch holds each structure rotated
        (``x_batch = x_ase @ R.T``, e.g. to a lower-triangular cell); positions,
        velocities, cell, forces and stress are rotated back before writing.
    positions : bool or numpy.ndarray, shape (B,), bool
        Write positions and cell (False for structures that did not move, so
        they keep their exact float64 values instead of the batch's rounded
        copy); an array chooses per structure.
    only : sequence of int, optional
        Write these structures only (indices into ``images``, all B given);
        the others are not touched. Default: every structure.

    Raises
    ------
    ValueError
        If the numbers of structures or atoms differ (nothing is written).
    """
    atoms_list = as_atoms_list(images)
    host = _HostCopy(batch, rotation=rotation)
    _check_same_shape(atoms_list, host)
    count = len(atoms_list)
    chosen = range(count) if only is None else [int(k) for k in only]
    result_dicts = _results_from_host(host, chosen) if results else None
    write_momenta = np.broadcast_to(np.asarray(momenta, dtype=bool), (count,))
    write_positions = np.broadcast_to(np.asarray(positions, dtype=bool), (count,))
    for entry_index, index in enumerate(chosen):
        atoms = atoms_list[index]
        if write_positions[index]:
            atoms.positions[:] = host.split("positions", index)
            padding = host.system("cell_padding", index)
            cell = atoms.cell.array.copy()
            new_cell = host.system("cell", index)
            cell[~padding] = new_cell[~padding]
            # the batch already obeys the constraints (dynamics/constraints.py);
            # FixSymmetry.adjust_cell would treat the whole run as one step
            atoms.set_cell(cell, apply_constraint=False)
        if write_momenta[index]:
            _write_momenta(atoms, host, index)
        if result_dicts is not None and result_dicts[entry_index]:
            entry = result_dicts[entry_index]
            if not stress:
                entry.pop("stress", None)
            _store_results(atoms, entry)


def batch_results(
    batch: Batch, outputs: Mapping[str, torch.Tensor] | None = None
) -> list[dict[str, Any]]:
    """Per-structure ASE results held by a batch (or by a model's outputs for it).

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        B graphs; ``energy`` [B, 1], ``forces`` [V, 3] and ``stress`` [B, 3, 3]
        are read from it when ``outputs`` does not hold them.
    outputs : mapping of str to torch.Tensor, optional
        A model's output dict for this batch. Besides energy, forces and stress it
        may hold ``atomic_energies`` [V] (reported as ASE ``energies``) and
        ``charges`` [V] (reported as ASE ``charges``).

    Returns
    -------
    list of dict
        One dict per structure with ``energy`` and ``free_energy`` (float, eV),
        ``forces`` (numpy.ndarray (N, 3), eV/Å), ``stress`` (numpy.ndarray (6,),
        Voigt xx yy zz yz xz xy, eV/Å³; only when the structure's ASE cell has
        rank 3, ASE's rule), ``energies`` (N,) eV and ``charges`` (N,) e, each key
        only when available.
    """
    return _results_from_host(_HostCopy(batch, outputs))


def _results_from_host(
    host: _HostCopy, chosen: Iterable[int] | None = None
) -> list[dict[str, Any]]:
    """Per-structure result dicts of the ``chosen`` structures (default: all)."""
    energy = host.optional("energy")
    forces = host.optional("forces")
    stress = host.optional("stress")
    stress_voigt = None if stress is None else stress_3x3_to_voigt(stress)
    has_full_cell = host.has_full_cell()
    per_atom = {
        ase_key: host.output_only(key)
        for ase_key, key in (("energies", "atomic_energies"), ("charges", "charges"))
    }
    per_structure: list[dict[str, Any]] = []
    for index in range(host.num_graphs) if chosen is None else chosen:
        atoms_slice = slice(host.ptr[index], host.ptr[index + 1])
        entry: dict[str, Any] = {}
        if energy is not None:
            entry["energy"] = float(energy[index].reshape(-1)[0])
            entry["free_energy"] = entry["energy"]
        if forces is not None:
            entry["forces"] = forces[atoms_slice].copy()
        if stress_voigt is not None and has_full_cell[index]:
            entry["stress"] = stress_voigt[index].copy()
        for ase_key, values in per_atom.items():
            if values is not None:
                entry[ase_key] = values[atoms_slice].reshape(-1).copy()
        per_structure.append(entry)
    return per_structure


# --------------------------------------------------------------------------
# Atoms -> stacked NumPy arrays (validation happens here, before any tensor)
# --------------------------------------------------------------------------


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


def _structure_of(atom_index: int, ptr: npt.NDArray[np.int64]) -> tuple[int, int]:
    structure = int(np.searchsorted(ptr, atom_index, side="right") - 1)
    return structure, int(atom_index - ptr[structure])


def _check_atoms_fields(
    numbers: npt.NDArray[Any], positions: npt.NDArray[Any], ptr: npt.NDArray[np.int64]
) -> None:
    bad = np.flatnonzero(~np.isfinite(positions).all(axis=1))
    if bad.size:
        structure, atom = _structure_of(int(bad[0]), ptr)
        raise StructureError(
            structure,
            f"positions[{atom}]",
            f"is not finite ({positions[bad[0]].tolist()})",
            "fix or remove that structure; nothing was computed",
        )
    bad = np.flatnonzero((numbers < 1) | (numbers > MAX_ATOMIC_NUMBER))
    if bad.size:
        structure, atom = _structure_of(int(bad[0]), ptr)
        raise StructureError(
            structure,
            f"numbers[{atom}]",
            f"atomic number {int(numbers[bad[0]])} is outside 1-118",
            "use real elements (ghost atoms 'X' = 0 cannot be simulated)",
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
    bad = np.flatnonzero(~(masses > 0) | ~np.isfinite(masses))
    if bad.size:
        structure, atom = _structure_of(int(bad[0]), ptr)
        raise StructureError(
            structure,
            f"masses[{atom}]",
            f"mass {masses[bad[0]]} is not positive",
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
    bad = np.flatnonzero(~np.isfinite(momenta).all(axis=1))
    if bad.size:
        structure, atom = _structure_of(int(bad[0]), ptr)
        raise StructureError(
            structure,
            f"momenta[{atom}]",
            "is not finite",
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


# --------------------------------------------------------------------------
# Validation beyond single fields: per-atom arrays, distances, model fit
# --------------------------------------------------------------------------

#: Carried per-atom arrays: shape after the atom axis, accepted dtype kinds
#: (NumPy ``dtype.kind``), and the ``Atoms`` method that sets them correctly.
_ARRAY_RULES: dict[str, tuple[tuple[int, ...], str, str]] = {
    "numbers": ((), "iu", "set_atomic_numbers"),
    "positions": ((3,), "iuf", "set_positions"),
    "masses": ((), "iuf", "set_masses"),
    "momenta": ((3,), "iuf", "set_momenta"),
    "initial_charges": ((), "iuf", "set_initial_charges"),
    "tags": ((), "iu", "set_tags"),
}
_KIND_NAMES = {"iu": "integer", "iuf": "real numbers"}
#: Shifted grids of the distance check: D + 1 grids, shifted by 1/(D + 1) of a bin
#: along every axis, put every pair closer than 1/(D + 1) of a bin into one bin
#: of at least one grid (in D = 3 dimensions; each axis can separate the pair in
#: at most one grid).
_GRIDS = 4
#: Structures whose periodic heights are all above this (Å) are searched with
#: fractional coordinates wrapped once: the close image of a pair is then the
#: only one within half a cell, and no atom is near its own image.
_THIN_HEIGHT = 2.0 * MIN_DISTANCE


def _check_skin(skin: Any) -> float:
    if isinstance(skin, bool) or not isinstance(skin, numbers.Real):
        raise TypeError(f"skin must be a number (Å), got {skin!r}")
    value = float(skin)
    if not (np.isfinite(value) and value >= 0.0):
        raise ValueError(f"skin must be finite and >= 0 Å, got {value}")
    return value


def _check_atom_arrays(atoms_list: list[Atoms]) -> None:
    """Check that carried per-atom arrays have one row per atom, numeric dtypes.

    ASE checks shapes in ``set_array`` but not when ``atoms.arrays`` is assigned
    directly; a wrong array would otherwise surface as a NumPy or torch error.
    """
    for index, atoms in enumerate(atoms_list):
        arrays = atoms.arrays
        count = len(arrays["positions"])
        shapes = {(): (count,), (3,): (count, 3)}
        for key, value in arrays.items():
            rule = _ARRAY_RULES.get(key)
            if rule is None:
                continue
            trailing, kinds, setter = rule
            if not isinstance(value, np.ndarray):
                value = np.asarray(value)
            if value.dtype.kind not in kinds:
                raise StructureError(
                    index,
                    key,
                    f"has dtype {value.dtype}, not {_KIND_NAMES[kinds]}",
                    f"set it with atoms.{setter}(...) or delete it "
                    f'(del atoms.arrays["{key}"])',
                )
            if value.shape != shapes[trailing]:
                raise StructureError(
                    index,
                    key,
                    f"has shape {value.shape} for {count} atoms; expected "
                    f"{shapes[trailing]}",
                    f"set it with atoms.{setter}(...) (one row per atom) or delete "
                    f'it (del atoms.arrays["{key}"])',
                )


def _check_finite_charges(
    charges: npt.NDArray[np.float64] | None, ptr: npt.NDArray[np.int64]
) -> None:
    if charges is None:
        return
    bad = np.flatnonzero(~np.isfinite(charges))
    if bad.size:
        structure, atom = _structure_of(int(bad[0]), ptr)
        raise StructureError(
            structure,
            f"initial_charges[{atom}]",
            f"charge {charges[bad[0]]} is not finite",
            "set finite charges in e (atoms.set_initial_charges)",
        )


@dataclass
class _Close:
    """Two atoms (or an atom and its own image) closer than ``MIN_DISTANCE``."""

    structure: int
    first: int
    second: int
    distance: float
    periodic: bool
    vector: npt.NDArray[np.float64] | None = None

    def error(self) -> StructureError:
        if self.first == self.second:
            vector = np.round(np.asarray(self.vector), 6).tolist()
            return StructureError(
                self.structure,
                "cell",
                f"atom {self.first} is {self.distance:.3g} Å from its own periodic "
                f"image: the lattice holds the vector {vector} Å, shorter than "
                f"the minimum distance of {MIN_DISTANCE} Å between atoms",
                "the cell is too small or its periodic vectors are (nearly) "
                "parallel; set the intended lattice vectors",
            )
        image = " (a periodic image of it)" if self.periodic else ""
        return StructureError(
            self.structure,
            f"positions[{self.second}]",
            f"atom {self.second} is {self.distance:.3g} Å from atom "
            f"{self.first}{image}, closer than the minimum of {MIN_DISTANCE} Å",
            "atoms this close are almost always a duplicated site (e.g. a CIF "
            f"with partial occupancies read as full sites); remove one (del "
            f"atoms[{self.second}], or ase.geometry.get_duplicate_atoms(atoms, "
            f"cutoff={MIN_DISTANCE}, delete=True) for every such pair)",
        )


def _check_distances(
    positions: npt.NDArray[np.float64],
    cell: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    ptr: npt.NDArray[np.int64],
) -> None:
    """Raise for the first structure with atoms closer than :data:`MIN_DISTANCE`.

    Periodic images count, an atom's own included. All structures are searched
    at once with shifted grids (:func:`_close_by_grids`, a few sorts of the
    V atoms); a structure with a periodic height below ``2 * MIN_DISTANCE`` is
    first given a Minkowski-reduced basis of the same lattice, and searched
    as a supercell if it is still that thin.
    """
    frames = _search_frames(cell, pbc)
    found: list[_Close] = []
    for index in np.flatnonzero(_thin(frames, pbc)):
        frames[index], own_image = _reduced_frame(int(index), frames[index], pbc[index])
        if own_image is not None:
            found.append(own_image)
    thin = _thin(frames, pbc)
    owner = np.repeat(np.arange(len(cell)), np.diff(ptr))
    by_grid = _close_by_grids(positions, frames, pbc, ptr, owner, ~thin[owner])
    if by_grid is not None:
        found.append(by_grid)
    for index in np.flatnonzero(thin):
        if found and min(c.structure for c in found) <= index:
            break
        atoms_slice = slice(ptr[index], ptr[index + 1])
        close = _close_in_supercell(
            int(index), positions[atoms_slice], frames[index], pbc[index]
        )
        if close is not None:
            found.append(close)
            break
    if found:
        raise min(found, key=lambda close: close.structure).error()


def _search_frames(
    cell: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    """Return each structure's periodic lattice vectors and orthonormal others.

    Rows on periodic axes are the cell's; the others are unit vectors orthogonal
    to them and to each other, so fractional coordinates along non-periodic
    axes are Å (the user's vectors there may be zero or arbitrary).
    """
    frames = np.where(pbc[:, :, None], cell, 0.0)
    n_periodic = pbc.sum(axis=1)
    frames[n_periodic == 0] = np.eye(3)
    slabs, axis = np.nonzero(~pbc & (n_periodic == 2)[:, None])
    if slabs.size:
        normal = np.cross(cell[slabs, (axis + 1) % 3], cell[slabs, (axis + 2) % 3])
        frames[slabs, axis] = normal / np.linalg.norm(normal, axis=1, keepdims=True)
    wires, axis = np.nonzero(pbc & (n_periodic == 1)[:, None])
    if wires.size:
        along = cell[wires, axis] / np.linalg.norm(
            cell[wires, axis], axis=1, keepdims=True
        )
        helper = np.eye(3)[np.argmin(np.abs(along), axis=1)]
        first = np.cross(along, helper)
        first /= np.linalg.norm(first, axis=1, keepdims=True)
        frames[wires, (axis + 1) % 3] = first
        frames[wires, (axis + 2) % 3] = np.cross(along, first)
    return frames


def _heights(cells: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Distance between the lattice planes of each axis, Å, shape (B, 3)."""
    volume = np.abs(np.linalg.det(cells))
    faces = np.cross(np.roll(cells, -1, axis=1), np.roll(cells, -2, axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return volume[:, None] / np.linalg.norm(faces, axis=2)


def _thin(
    frames: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    return np.any((_heights(frames) <= _THIN_HEIGHT) & pbc, axis=1)


def _reduced_frame(
    index: int, frame: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]
) -> tuple[npt.NDArray[np.float64], _Close | None]:
    """Return a Minkowski-reduced basis of the same lattice, and any own-image pair.

    The reduced basis holds the lattice's shortest vector, so an atom is closer
    than ``MIN_DISTANCE`` to its own image exactly when a periodic row is.
    """
    from ase.geometry import minkowski_reduce

    reduced, _ = minkowski_reduce(frame, pbc)
    lengths = np.where(pbc, np.linalg.norm(reduced, axis=1), np.inf)
    axis = int(np.argmin(lengths))
    if lengths[axis] < MIN_DISTANCE:
        own = _Close(index, 0, 0, float(lengths[axis]), True, reduced[axis])
        return reduced, own
    return reduced, None


def _close_by_grids(
    positions: npt.NDArray[np.float64],
    frames: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    ptr: npt.NDArray[np.int64],
    owner: npt.NDArray[np.int64],
    include: npt.NDArray[np.bool_],
) -> _Close | None:
    """Return the first pair closer than ``MIN_DISTANCE`` (``include``d atoms).

    Fractional coordinates (wrapped on periodic axes) are binned into cells of
    height ``_GRIDS * MIN_DISTANCE`` or more; every close pair shares a bin in
    one of the ``_GRIDS`` shifted grids. Per grid, atoms alone in their hash
    bucket are dropped (one ``bincount``), the rest are sorted by bin and
    neighbours in that order compared. Real structures have at most one or two
    atoms per bin, so almost no distance is computed.
    """
    if len(frames) == 1:  # one structure: broadcast instead of per-atom copies

        def per_atom(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return values

        fractional = positions @ np.linalg.inv(frames[0])
    else:

        def per_atom(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return values[owner]

        inverse = np.linalg.inv(frames)[owner]
        fractional = np.einsum("vi,vij->vj", positions, inverse)
    periodic = per_atom(pbc)
    fractional = np.where(periodic, fractional - np.floor(fractional), fractional)
    per_unit = _heights(frames) / (_GRIDS * MIN_DISTANCE)
    bins = np.where(pbc, np.maximum(np.floor(per_unit), 1.0), per_unit)
    scaled = fractional * per_atom(bins)
    starts = ptr[:-1]
    lowest = np.floor(np.minimum.reduceat(scaled, starts, axis=0))
    scaled = np.where(periodic, scaled, scaled - per_atom(lowest))  # all >= 0
    span = np.where(pbc, bins, np.floor(np.maximum.reduceat(scaled, starts)) + 2)
    packed = float(np.prod(span, axis=1).sum()) < 2.0**62
    span_b = span.astype(np.int64)
    base_b = np.concatenate([[0], np.cumsum(np.prod(span_b, axis=1))[:-1]])
    weight_b = np.stack([span_b[:, 1] * span_b[:, 2], span_b[:, 2]], axis=1)
    span_v, weight_v, base_v = per_atom(span_b), per_atom(weight_b), per_atom(base_b)
    atoms = np.arange(len(positions)) if include.all() else np.flatnonzero(include)
    close: _Close | None = None
    grid = 0
    while grid < _GRIDS and atoms.size >= 2:
        chosen = None if atoms.size == len(positions) else atoms
        # truncation is floor here (scaled >= 0); a periodic axis' last bin wraps
        cells = (_rows(scaled, chosen) + grid / _GRIDS).astype(np.int64)
        spans = _rows(span_v, chosen)
        cells -= spans * (cells >= spans)
        if packed:
            weights = _rows(weight_v, chosen)
            keys = (
                _rows(base_v, chosen)
                + cells[:, 0] * weights[:, 0]
                + cells[:, 1] * weights[:, 1]
                + cells[:, 2]
            )
            shared = _sharing_a_bucket(keys)
            order = shared[np.argsort(keys[shared])]
            sorted_keys = keys[order, None]
        else:  # astronomically many bins: compare (structure, bin) rows
            rows = np.column_stack([owner[atoms], cells])
            order = np.lexsort(rows.T[::-1])
            sorted_keys = rows[order]
        found = _scan_sorted(atoms[order], sorted_keys, fractional, pbc, frames, owner)
        if found is None:
            grid += 1
        else:  # look again, for a close pair in an earlier structure
            close = _pair(*found, positions, ptr)
            atoms = atoms[owner[atoms] < close.structure]
    return close


def _rows(
    values: npt.NDArray[Any], atoms: npt.NDArray[np.int64] | None
) -> npt.NDArray[Any]:
    """Select ``atoms`` from per-atom ``values`` (one shared row is kept as is)."""
    return values if atoms is None or len(values) == 1 else values[atoms]


def _sharing_a_bucket(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Return the positions of keys whose hash bucket holds another key too.

    Equal keys share a bucket, so no pair of equal keys is lost; with four
    buckets per key about a fifth of distinct keys collide.
    """
    buckets = keys % (4 * len(keys) + 1)
    counts = np.bincount(buckets)
    return np.flatnonzero(counts[buckets] > 1)


def _scan_sorted(
    atoms: npt.NDArray[np.int64],
    keys: npt.NDArray[np.int64],
    fractional: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    frames: npt.NDArray[np.float64],
    owner: npt.NDArray[np.int64],
) -> tuple[int, int, int, float] | None:
    """Return the first close pair (structure, atom, atom, Å) sharing a bin.

    ``atoms`` are sorted by bin (``keys``); two atoms of one bin are ``step``
    apart in that order for some ``step`` below the bin's size.
    """
    for step in range(1, len(atoms)):
        same = (keys[step:] == keys[:-step]).all(axis=1)
        if not same.any():
            return None
        first, second = atoms[:-step][same], atoms[step:][same]
        difference = fractional[second] - fractional[first]
        structure = owner[first]
        difference = np.where(
            pbc[structure], difference - np.round(difference), difference
        )
        vectors = np.einsum("pi,pij->pj", difference, frames[structure])
        distance = np.linalg.norm(vectors, axis=1)
        bad = np.flatnonzero(distance < MIN_DISTANCE)
        if bad.size:
            low = np.minimum(first[bad], second[bad])
            high = np.maximum(first[bad], second[bad])
            pick = np.lexsort((low, high, owner[low]))[0]
            return (
                int(owner[low[pick]]),
                int(low[pick]),
                int(high[pick]),
                float(distance[bad[pick]]),
            )
    return None


def _pair(
    structure: int,
    first: int,
    second: int,
    distance: float,
    positions: npt.NDArray[np.float64],
    ptr: npt.NDArray[np.int64],
) -> _Close:
    """Name a close pair of global atom indices within its structure."""
    direct = float(np.linalg.norm(positions[second] - positions[first]))
    return _Close(
        structure,
        int(first - ptr[structure]),
        int(second - ptr[structure]),
        distance,
        periodic=abs(direct - distance) > 1e-9,
    )


def _close_in_supercell(
    index: int,
    positions: npt.NDArray[np.float64],
    frame: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
) -> _Close | None:
    """Find the close pair of one very thin structure through a supercell.

    The supercell repeats the (reduced) cell until every periodic height
    exceeds ``2 * MIN_DISTANCE``; each image of an atom near another one (or
    near itself) is then a copy in the supercell, found by the shifted grids.
    """
    repeats = np.where(pbc, np.floor(_THIN_HEIGHT / _heights(frame[None])[0]) + 1, 1)
    grid = np.stack(
        np.meshgrid(*(np.arange(int(r)) for r in repeats), indexing="ij"), axis=-1
    ).reshape(-1, 3)
    copies = (positions[None, :, :] + (grid @ frame)[:, None, :]).reshape(-1, 3)
    count = len(positions)
    close = _close_by_grids(
        copies,
        (frame * repeats[:, None])[None],
        pbc[None],
        np.array([0, len(copies)]),
        np.zeros(len(copies), dtype=np.int64),
        np.ones(len(copies), dtype=bool),
    )
    if close is None:
        return None
    first, second = close.first % count, close.second % count
    vector = copies[close.second] - copies[close.first]
    if first > second:
        first, second = second, first
    return _Close(index, first, second, close.distance, True, vector)


def _check_model_fit(stacked: _Stacked, model: Any, skin: float) -> None:
    """Run the checks of :func:`check_images` that need the model."""
    name = type(model).__name__
    elements = _supported_elements(model)
    if elements is not None:
        _check_elements(stacked, elements, name)
    config = getattr(getattr(model, "model_config", None), "neighbor_config", None)
    if config is not None and stacked.pbc_b.any():
        _check_cell_heights(stacked, float(config.cutoff), skin, name)


def _supported_elements(model: Any) -> frozenset[int] | None:
    """Return the atomic numbers ``model`` can evaluate, None for any."""
    declared = getattr(model, "supported_elements", None)
    if declared is not None:
        try:
            return frozenset(int(z) for z in declared)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{type(model).__name__}.supported_elements must be atomic numbers "
                f"(ints) or None, got {declared!r}"
            ) from error
    if type(model).__name__ == "DemoModelWrapper":
        # nvalchemi's DemoModel embeds the atomic number itself:
        # nn.Embedding(num_atom_types, ...) accepts 0 .. num_atom_types - 1.
        embedding = getattr(getattr(model, "model", None), "embedding", None)
        if isinstance(embedding, torch.nn.Embedding):
            return frozenset(range(1, int(embedding.num_embeddings)))
    return None


def _check_elements(stacked: _Stacked, elements: frozenset[int], name: str) -> None:
    known = np.zeros(MAX_ATOMIC_NUMBER + 1, dtype=bool)
    known[[z for z in elements if 0 <= z <= MAX_ATOMIC_NUMBER]] = True
    bad = np.flatnonzero(~known[stacked.numbers_v])
    if not bad.size:
        return
    ptr = np.concatenate([[0], np.cumsum(stacked.counts_b)])
    structure, atom = _structure_of(int(bad[0]), ptr)
    numbers = stacked.numbers_v[ptr[structure] : ptr[structure + 1]]
    missing = [chemical_symbols[z] for z in np.unique(numbers[~known[numbers]])]
    number = int(stacked.numbers_v[bad[0]])
    raise StructureError(
        structure,
        f"numbers[{atom}]",
        f"{name} cannot evaluate {', '.join(missing)} (atom {atom} is "
        f"{chemical_symbols[number]}, Z = {number})",
        f"it supports {len(elements)} elements ({_element_ranges(elements)}); "
        "remove or replace those atoms, or use a model trained on them",
    )


def _element_ranges(elements: frozenset[int]) -> str:
    """``"H-Ar, K"``: runs of consecutive atomic numbers as symbol ranges."""
    numbers = sorted(z for z in elements if 1 <= z <= MAX_ATOMIC_NUMBER)
    runs: list[list[int]] = []
    for z in numbers:
        if runs and z == runs[-1][-1] + 1:
            runs[-1].append(z)
        else:
            runs.append([z])
    return ", ".join(
        chemical_symbols[run[0]]
        if len(run) == 1
        else f"{chemical_symbols[run[0]]}-{chemical_symbols[run[-1]]}"
        for run in runs
    )


def _check_cell_heights(
    stacked: _Stacked, cutoff: float, skin: float, name: str
) -> None:
    """Check no periodic axis needs over :data:`MAX_PERIODIC_IMAGES` images a side.

    nvalchemi's neighbour list searches ``ceil(reach / height)`` images on each
    side of every periodic axis of the cell it is given (the padded cell of
    :func:`atoms_to_batch`), ``reach = cutoff + skin``.
    """
    ptr = np.concatenate([[0], np.cumsum(stacked.counts_b)])
    padded, _ = _padded_cells(stacked.cell_b, stacked.pbc_b, stacked.positions_v, ptr)
    heights = _heights(padded)
    reach = cutoff + skin
    with np.errstate(divide="ignore", invalid="ignore"):
        images = np.ceil(reach / heights)
    too_many = stacked.pbc_b & ~(images <= MAX_PERIODIC_IMAGES)
    for index, axis in zip(*np.nonzero(too_many), strict=True):
        index, axis = int(index), int(axis)
        height = float(heights[index, axis])
        needed = np.ceil(
            reach / (MAX_PERIODIC_IMAGES * np.maximum(heights[index], 1e-300))
        )
        repeat = tuple(
            int(n) if bad else 1 for n, bad in zip(needed, too_many[index], strict=True)
        )
        raise StructureError(
            index,
            "cell",
            f"periodic axis {axis} is only {height:.3g} Å high (the distance "
            f"between its lattice planes), so the neighbour search to {reach:g} Å "
            f"({name}'s cutoff {cutoff:g} Å + skin {skin:g} Å) would need "
            f"{images[index, axis]:.0f} periodic images per side, more than "
            f"{MAX_PERIODIC_IMAGES}",
            _height_fix(padded[index], stacked.pbc_b[index], reach, repeat),
        )


def _height_fix(
    cell: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    reach: float,
    repeat: tuple[int, ...],
) -> str:
    from ase.geometry import minkowski_reduce

    fix = f"use a supercell, atoms * {repeat}, or a larger cell"
    reduced, _ = minkowski_reduce(cell, pbc)
    lowest = float(np.min(_heights(reduced[None])[0][pbc]))
    if np.ceil(reach / lowest) <= MAX_PERIODIC_IMAGES:
        reducer = (
            "ase.build.niggli_reduce(atoms)"
            if pbc.all()
            else "the basis from ase.geometry.minkowski_reduce(atoms.cell, atoms.pbc)"
        )
        fix = (
            "its lattice vectors are a needlessly skewed choice: a reduced basis "
            f"of the same lattice is at least {lowest:.3g} Å high; use {reducer}, "
            f"or {fix.removeprefix('use ')}"
        )
    return fix


def _warn_not_carried(atoms_list: list[Atoms]) -> None:
    dropped: set[str] = set()
    for atoms in atoms_list:
        dropped.update(
            f'arrays["{key}"]' for key in atoms.arrays.keys() - _CARRIED_ARRAYS
        )
        dropped.update(f'info["{key}"]' for key in atoms.info.keys() - _CARRIED_INFO)
        dropped.update(
            f"constraint {type(c).__name__}"
            for c in atoms.constraints
            if not isinstance(c, FixAtoms)
        )
    # One warning per key and call site: Python's warnings registry (the
    # default action) shows each message once per line; no state of ours.
    for key in sorted(dropped):
        warnings.warn(
            f"{key} has no nvalchemi Batch field and is not carried into the batch "
            "(update_atoms writes back into the original Atoms, which keep it)",
            NotCarriedWarning,
            stacklevel=3,
        )


# --------------------------------------------------------------------------
# Stacked arrays -> Batch
# --------------------------------------------------------------------------


def _padded_cells(
    cell: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    positions: npt.NDArray[np.float64],
    ptr: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Replace zero, non-periodic cell vectors by orthogonal stand-ins.

    nvalchemi's neighbour lists and models need an invertible cell for every
    graph once any graph in the batch is periodic. A stand-in vector is
    orthogonal to the structure's other cell vectors and only spans the
    structure (its length is the structure's extent along it plus 1 Å); no
    periodic image is ever generated along it because its ``pbc`` entry is False.
    Molecules (three stand-ins) and slabs (one) are handled in bulk; the rare
    wire (two stand-ins) one structure at a time.
    """
    padding = (np.linalg.norm(cell, axis=2) == 0.0) & ~pbc
    padded = cell.copy()
    n_padded = padding.sum(axis=1)
    starts = ptr[:-1]

    molecules = np.flatnonzero(n_padded == 3)
    if molecules.size:
        extent = (
            np.maximum.reduceat(positions, starts)[molecules]
            - np.minimum.reduceat(positions, starts)[molecules]
        )
        padded[molecules] = np.eye(3) * (extent + 1.0)[:, None, :]

    slabs, slab_axis = np.nonzero(padding & (n_padded == 1)[:, None])
    if slabs.size:
        first = cell[slabs, (slab_axis + 1) % 3]
        second = cell[slabs, (slab_axis + 2) % 3]
        normal = np.cross(first, second)  # cyclic order keeps det(cell) > 0
        normal /= np.linalg.norm(normal, axis=1, keepdims=True)
        structure_of_atom = np.repeat(np.arange(len(cell)), np.diff(ptr))
        normal_of_atom = np.zeros((len(positions), 3))
        normal_by_structure = np.zeros((len(cell), 3))
        normal_by_structure[slabs] = normal
        normal_of_atom[:] = normal_by_structure[structure_of_atom]
        height = np.einsum("ij,ij->i", positions, normal_of_atom)
        extent = np.maximum.reduceat(height, starts) - np.minimum.reduceat(
            height, starts
        )
        padded[slabs, slab_axis] = normal * (extent[slabs] + 1.0)[:, None]

    for index in np.flatnonzero(n_padded == 2):
        rows = padded[index]
        kept = [rows[k] for k in range(3) if not padding[index, k]]
        for axis in np.flatnonzero(padding[index]):
            direction = _orthogonal_direction(kept, preferred_axis=int(axis))
            coords = positions[ptr[index] : ptr[index + 1]] @ direction
            rows[axis] = direction * (np.ptp(coords) + 1.0)
            kept.append(rows[axis])
        if np.linalg.det(rows) < 0:
            rows[np.flatnonzero(padding[index])[0]] *= -1.0
    return padded, padding


def _orthogonal_direction(
    kept: list[npt.NDArray[np.float64]], preferred_axis: int
) -> npt.NDArray[np.float64]:
    """Return a unit vector orthogonal to ``kept``, near a Cartesian axis."""
    for offset in range(3):
        vector = np.eye(3)[(preferred_axis + offset) % 3]
        for _ in range(2):  # two Gram-Schmidt passes for numerical orthogonality
            for other in kept:
                unit = other / np.linalg.norm(other)
                vector = vector - (vector @ unit) * unit
        if np.linalg.norm(vector) > 1e-6:
            return vector / np.linalg.norm(vector)
    raise AssertionError("three kept vectors leave no orthogonal direction")


def _build_batch(stacked: _Stacked, device: torch.device, dtype: torch.dtype) -> Batch:
    level_storage = import_quietly("nvalchemi.data.level_storage")
    data_module = import_quietly("nvalchemi.data")

    ptr = np.concatenate([[0], np.cumsum(stacked.counts_b)])
    cell, padding = _padded_cells(
        stacked.cell_b, stacked.pbc_b, stacked.positions_v, ptr
    )

    def floating(array: npt.NDArray[Any]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype)

    def exact(array: npt.NDArray[Any], int_dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, int_dtype)

    categories = np.where(stacked.frozen_v, FROZEN_CATEGORY, 0)
    atom_fields = {
        "positions": floating(stacked.positions_v),
        "atomic_numbers": exact(stacked.numbers_v, torch.int32),
        "atomic_masses": floating(stacked.masses_v),
        "atom_categories": exact(categories, torch.int64),
        "velocities": floating(stacked.velocities_v),
    }
    if stacked.charges_v is not None:
        atom_fields["charges"] = floating(stacked.charges_v)
    if stacked.tags_v is not None:
        atom_fields["tags"] = exact(stacked.tags_v, torch.int64)

    system_fields = {
        "cell": floating(cell),
        "pbc": exact(stacked.pbc_b, torch.bool),
        "cell_padding": exact(padding, torch.bool),
    }
    if stacked.charge_b is not None:
        system_fields["charge"] = floating(stacked.charge_b[:, None])
    if stacked.spin_b is not None:
        system_fields["spin"] = floating(stacked.spin_b[:, None])

    schema = data_module.LevelSchema()
    for key, value in atom_fields.items():
        schema.set(key, "atoms", dtype=value.dtype, is_segmented=True)
    for key, value in system_fields.items():
        schema.set(key, "system", dtype=value.dtype, is_segmented=False)
    groups = {
        "atoms": level_storage.SegmentedLevelStorage(
            data=atom_fields,
            device=device,
            attr_map=schema,
            segment_lengths=stacked.counts_b.tolist(),
            validate=False,
        ),
        "system": level_storage.UniformLevelStorage(
            data=system_fields, device=device, attr_map=schema, validate=False
        ),
    }
    storage = level_storage.MultiLevelStorage(
        groups=groups, attr_map=schema, validate=False, device=device
    )
    keys = {"node": set(atom_fields), "edge": set(), "system": set(system_fields)}
    return data_module.Batch(device=device, storage=storage, keys=keys)


# --------------------------------------------------------------------------
# Batch -> host NumPy arrays -> Atoms
# --------------------------------------------------------------------------


class _HostCopy:
    """One device-to-host transfer per field, then per-structure NumPy views."""

    def __init__(
        self,
        batch: Batch,
        outputs: Mapping[str, torch.Tensor] | None = None,
        rotation: npt.NDArray[np.float64] | None = None,
    ) -> None:
        self._batch = batch
        self._outputs = outputs or {}
        self._rotation = rotation
        self._cache: dict[str, npt.NDArray[Any] | None] = {}
        self._flags: dict[str, npt.NDArray[np.bool_]] = {}
        self.ptr = batch.batch_ptr.detach().cpu().numpy().astype(np.int64)
        self.num_graphs = int(batch.num_graphs)

    def optional(self, key: str) -> npt.NDArray[Any] | None:
        if key not in self._cache:
            value = self._outputs.get(key)
            if value is None:
                value = batch_field(self._batch, key)
            array = None if value is None else _to_numpy(value)
            if array is not None and self._rotation is not None:
                array = self._unrotate(key, array)
            self._cache[key] = array
        return self._cache[key]

    def _unrotate(self, key: str, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Undo a per-structure rotation ``x_batch = x_ase @ R.T`` (R orthogonal)."""
        rotation = self._rotation
        if rotation is None:
            return array
        if key in _ATOM_VECTORS:
            per_atom = np.repeat(rotation, np.diff(self.ptr), axis=0)
            return np.einsum("vj,vjk->vk", array, per_atom)
        if key == "cell":
            return np.einsum("bij,bjk->bik", array, rotation)
        if key == "stress":  # a tensor: sigma_ase = R^T sigma_batch R
            return np.einsum("bji,bjk,bkl->bil", rotation, array, rotation)
        return array

    def output_only(self, key: str) -> npt.NDArray[Any] | None:
        value = self._outputs.get(key)
        return None if value is None else _to_numpy(value)

    def required(self, key: str) -> npt.NDArray[Any]:
        value = self.optional(key)
        if value is None:
            raise ValueError(f"the batch has no '{key}' field")
        return value

    def split(self, key: str, index: int) -> npt.NDArray[Any]:
        return self.required(key)[self.ptr[index] : self.ptr[index + 1]]

    def system(self, key: str, index: int) -> npt.NDArray[Any]:
        if key == "cell_padding" and self.optional(key) is None:
            return np.zeros(3, dtype=bool)
        if key == "pbc" and self.optional(key) is None:
            return np.zeros(3, dtype=bool)
        if key == "cell" and self.optional(key) is None:
            return np.zeros((3, 3))
        return self.required(key)[index]

    def cell(self, index: int) -> npt.NDArray[np.float64]:
        cell = self.system("cell", index).copy()
        cell[self.system("cell_padding", index)] = 0.0
        return cell

    def any_per_structure(self, flag: str) -> npt.NDArray[np.bool_]:
        """Return, per structure, whether any atom has ``flag`` (bulk, cached).

        ``custom_masses``: a mass differs from ASE's default for its element;
        ``moving``: a velocity is non-zero; ``frozen``: an atom is frozen.
        """
        if flag not in self._flags:
            per_atom = self._atom_flag(flag).astype(np.int64)
            self._flags[flag] = np.add.reduceat(per_atom, self.ptr[:-1]) > 0
        return self._flags[flag]

    def _atom_flag(self, flag: str) -> npt.NDArray[np.bool_]:
        if flag == "custom_masses":
            numbers = self.required("atomic_numbers")
            masses = self.required("atomic_masses")
            return ~np.isclose(masses, ase_default_masses[numbers], rtol=1e-6, atol=0.0)
        if flag == "moving":
            velocities = self.optional("velocities")
            if velocities is None:
                return np.zeros(int(self.ptr[-1]), dtype=bool)
            return np.any(velocities != 0.0, axis=1)
        if flag == "frozen":
            categories = self.optional("atom_categories")
            if categories is None:
                return np.zeros(int(self.ptr[-1]), dtype=bool)
            return categories == FROZEN_CATEGORY
        raise KeyError(flag)

    def has_full_cell(self) -> npt.NDArray[np.bool_]:
        """Return, per structure, whether its ASE cell has rank 3 (stress rule)."""
        cells = self.optional("cell")
        if cells is None:
            return np.zeros(self.num_graphs, dtype=bool)
        padding = self.optional("cell_padding")
        if padding is None:
            padding = np.zeros((self.num_graphs, 3), dtype=bool)
        volume = np.abs(np.linalg.det(cells))
        scale = np.linalg.norm(cells, axis=2).prod(axis=1)
        return (~padding.any(axis=1)) & (volume > 1e-10 * np.maximum(scale, 1e-300))


def _to_numpy(tensor: torch.Tensor) -> npt.NDArray[Any]:
    tensor = tensor.detach()
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
    return tensor.cpu().numpy()


def batch_field(batch: Batch, key: str) -> torch.Tensor | None:
    """Return ``batch.<key>`` or ``None`` when the batch has no such tensor field.

    The one lookup of an optional field (the write-back, the models, the
    failure guard): a field the batch does not hold, or one that is not a
    tensor, is ``None``.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        Any batch (or ``AtomicData``).
    key : str
        Field name.

    Returns
    -------
    torch.Tensor or None
        The stored tensor (not a copy).
    """
    value = getattr(batch, key, None)
    return value if isinstance(value, torch.Tensor) else None


def _restore_optional_fields(atoms: Atoms, host: _HostCopy, index: int) -> None:
    if host.any_per_structure("custom_masses")[index]:
        atoms.set_masses(host.split("atomic_masses", index))
    if host.any_per_structure("moving")[index]:
        velocities = host.split("velocities", index)
        atoms.set_momenta(velocities_to_momenta(velocities, atoms.get_masses()))
    if host.optional("charges") is not None:
        atoms.set_initial_charges(host.split("charges", index))
    if host.optional("tags") is not None:
        atoms.set_tags(host.split("tags", index).astype(int))
    for key in sorted(_CARRIED_INFO):
        values = host.optional(key)
        if values is not None:
            value = float(values[index].reshape(-1)[0])
            atoms.info[key] = int(value) if value.is_integer() else value
    if host.any_per_structure("frozen")[index]:
        categories = host.split("atom_categories", index)
        atoms.set_constraint(
            FixAtoms(indices=np.flatnonzero(categories == FROZEN_CATEGORY))
        )


def _check_same_shape(atoms_list: list[Atoms], host: _HostCopy) -> None:
    if len(atoms_list) != host.num_graphs:
        raise ValueError(
            f"update_atoms got {len(atoms_list)} structures for a batch of "
            f"{host.num_graphs} graphs; pass the list the batch was built from"
        )
    counts = np.diff(host.ptr)
    for index, atoms in enumerate(atoms_list):
        if len(atoms) != counts[index]:
            raise ValueError(
                f"images[{index}] has {len(atoms)} atoms but graph {index} of the "
                f"batch has {counts[index]}; pass the list the batch was built from"
            )


def _write_momenta(atoms: Atoms, host: _HostCopy, index: int) -> None:
    if host.optional("velocities") is None:
        return
    velocities = host.split("velocities", index)
    if "momenta" in atoms.arrays or np.any(velocities != 0.0):
        momenta = velocities_to_momenta(velocities, atoms.get_masses())
        atoms.set_momenta(momenta, apply_constraint=False)


def _store_results(atoms: Atoms, results: dict[str, Any]) -> None:
    calc = atoms.calc
    if calc is not None and hasattr(calc, "store_results"):
        calc.store_results(atoms, results)
    elif calc is None or isinstance(calc, SinglePointCalculator):
        atoms.calc = SinglePointCalculator(atoms, **results)
