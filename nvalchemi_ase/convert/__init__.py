"""Lossless conversion between lists of ASE ``Atoms`` and an nvalchemi ``Batch``.

nvalchemi 0.3 offers ``AtomicData.from_atoms`` one structure at a time; it drops
momenta, tags, constraints and initial charges, refuses molecules mixed with
periodic systems, slabs without a third cell vector and left-handed cells, and
has no way back. This package builds the whole ``Batch`` in one vectorised pass
(the per-structure work is gathering arrays; there is no per-atom Python loop),
and converts back, field by field:

=========================  ==========================  ===============================
ASE                        Batch field (level, shape)  notes
=========================  ==========================  ===============================
``positions``              ``positions`` (atoms,       Å, not wrapped
                           [V, 3])
``numbers``                ``atomic_numbers`` (atoms,  int32 as ``from_atoms``; 0-118
                           [V])                        (0: ghost atom ``X``)
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

The package holds the public adapters; the work behind them is split by
concern: ``_stacking`` (``Atoms`` -> stacked NumPy arrays, single fields
checked), ``_validation`` (per-atom arrays, charges, the model's elements and
cutoff) and ``_close_pairs`` (the close-pair search), ``_storage`` (the
``Batch`` on nvalchemi's level storages) and ``_writeback`` (host copy and
``Atoms`` updates); ``_common`` holds the limits and errors they share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

from nvalchemi_ase.convert._common import (
    FROZEN_CATEGORY,
    MAX_ATOMIC_NUMBER,
    MAX_PERIODIC_IMAGES,
    MIN_DISTANCE,
    NotCarriedWarning,
    StructureError,
    _Stacked,
)
from nvalchemi_ase.convert._stacking import (
    _check_atoms_fields,
    _check_cells,
    _stack,
)
from nvalchemi_ase.convert._storage import (
    _build_batch,
    _padded_cells,
)
from nvalchemi_ase.convert._validation import (
    _check_model_fit,
    _check_skin,
    _warn_not_carried,
)
from nvalchemi_ase.convert._validation import _supported_elements as _supported_elements
from nvalchemi_ase.convert._writeback import (
    _check_same_shape,
    _HostCopy,
    _restore_optional_fields,
    _store_results,
    _write_momenta,
    batch_field,
)
from nvalchemi_ase.devices import DtypeLike, resolve_device, resolve_dtype
from nvalchemi_ase.units import stress_3x3_to_voigt

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = [
    "FROZEN_CATEGORY",
    "MAX_ATOMIC_NUMBER",
    "MAX_PERIODIC_IMAGES",
    "MIN_DISTANCE",
    "CheckedImages",
    "NotCarriedWarning",
    "StructureError",
    "as_atoms_list",
    "atoms_to_batch",
    "batch_field",
    "batch_from_checked",
    "batch_results",
    "batch_to_atoms",
    "check_images",
    "refresh_positions",
    "update_atoms",
]


# Shown and pickled under their public home.
StructureError.__module__ = NotCarriedWarning.__module__ = __name__


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


class CheckedImages:
    """Structures :func:`check_images` passed, stacked: what their batch is built from.

    Returned by :func:`check_images`; :func:`batch_from_checked` builds the
    batch from it without converting or checking the structures again (a
    runner checks the structures it admits, then builds their batch).

    Attributes
    ----------
    images : list of ase.Atoms
        The structures checked (the same objects, not copies).
    model : BaseModelMixin or None
        The model they were checked against.
    skin : float
        The Verlet skin, Å, of the cell-height check.
    """

    def __init__(
        self, images: list[Atoms], stacked: _Stacked, model: Any, skin: float
    ) -> None:
        self.images = images
        self.model = model
        self.skin = skin
        self._stacked: _Stacked | None = stacked

    def holds(self, images: Sequence[Atoms]) -> bool:
        """Whether these are the checked structures (the same objects, same order)."""
        return len(images) == len(self.images) and all(
            mine is theirs for mine, theirs in zip(self.images, images, strict=True)
        )


def check_images(
    images: Atoms | Sequence[Atoms], *, model: Any = None, skin: float = 0.0
) -> CheckedImages:
    """Validate structures before any work, as :func:`atoms_to_batch` does, and more.

    Without a model this runs exactly the checks of :func:`atoms_to_batch`
    (nothing is built): at least one atom; atomic numbers 0-118 (0 is
    ASE's ghost atom ``X``, mass 1.0 amu as in ASE); finite
    positions, cell, momenta and charges; positive masses; per-atom arrays of
    one row per atom and a numeric dtype; a lattice vector on every periodic
    axis; ``FixAtoms`` indices inside the structure (negative ones count from
    its end, as ASE's); finite numeric ``info["charge"]``/``info["spin"]``; no
    two atoms, or an atom and a periodic image of any atom (itself included),
    closer than :data:`MIN_DISTANCE`. With a model it also checks

    * the elements against the model's (``model.supported_elements``, see
      :func:`nvalchemi_ase.models.supported_elements`): ghost atoms (Z = 0)
      only for a model that reads no element (None, e.g. LJ) or that lists 0;
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

    Returns
    -------
    CheckedImages
        The structures' arrays as checked, from which
        :func:`batch_from_checked` builds their batch without a second pass.

    Raises
    ------
    StructureError
        For the first structure that cannot be simulated (index, field, fix).
    TypeError, ValueError
        For an ``images`` that is not ``Atoms``, an empty list, or a bad ``skin``.
    """
    skin = _check_skin(skin)
    atoms_list = as_atoms_list(images)
    stacked = _stack(atoms_list)
    if model is not None:
        _check_model_fit(stacked, model, skin)
    return CheckedImages(atoms_list, stacked, model, skin)


def batch_from_checked(
    checked: CheckedImages,
    *,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
) -> Batch:
    """Build the batch of structures :func:`check_images` passed, without a second pass.

    The same ``Batch`` as ``atoms_to_batch(checked.images, device=device,
    dtype=dtype, warn_dropped=False)`` (bit for bit), from the arrays the
    check stacked: the structures are neither converted nor checked again.
    It holds the structures as they were when checked (change an ``Atoms``
    after the check and check it again). The batch takes the checked arrays
    over without a copy, so each :class:`CheckedImages` builds one batch.

    Parameters
    ----------
    checked : CheckedImages
        What :func:`check_images` returned.
    device : torch.device or str or None
        Where the batch lives; ``None`` means CUDA when available, else CPU.
    dtype : torch.dtype or str or None
        Floating dtype (default ``torch.float64``), as for :func:`atoms_to_batch`.

    Returns
    -------
    nvalchemi.data.Batch
        B graphs, no neighbour list; fields as :func:`atoms_to_batch`'s.

    Raises
    ------
    ValueError
        If a batch was built from ``checked`` already.
    """
    stacked, checked._stacked = checked._stacked, None
    if stacked is None:
        raise ValueError(
            "these checked structures built a batch already (it holds their arrays); "
            "check them again with check_images for another batch"
        )
    return _build_batch(stacked, resolve_device(device), resolve_dtype(dtype))


def atoms_to_batch(
    images: Atoms | Sequence[Atoms],
    *,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    warn_dropped: bool = True,
    model: Any = None,
    skin: float = 0.0,
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
    model : BaseModelMixin, optional
        Also run :func:`check_images`' checks against this model (elements,
        cell heights against its cutoff plus ``skin``), in the same pass:
        ``check_images(images, model=model, skin=skin)`` then this function,
        without validating the structures twice.
    skin : float
        Verlet skin, Å, for the cell-height check (with ``model`` only).

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
    skin = _check_skin(skin)
    atoms_list = as_atoms_list(images)
    stacked = _stack(atoms_list)
    if model is not None:
        _check_model_fit(stacked, model, skin)
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
    outputs: Mapping[str, torch.Tensor] | None = None,
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
    outputs : mapping of str to torch.Tensor, optional
        Results to report instead of the batch's fields of the same name, e.g.
        ``forces`` [V, 3] eV/Å and ``stress`` [B, 3, 3] eV/Å³ as the model gave
        them before constraint hooks adjusted the batch's (ASE's calculator
        results are the raw ones; ``atoms.get_forces()`` applies the
        constraints).

    Raises
    ------
    ValueError
        If the numbers of structures or atoms differ (nothing is written).
    """
    atoms_list = as_atoms_list(images)
    host = _HostCopy(batch, outputs, rotation=rotation)
    count = len(atoms_list)
    chosen = range(count) if only is None else [int(k) for k in only]
    _check_same_shape(atoms_list, host, chosen)
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
