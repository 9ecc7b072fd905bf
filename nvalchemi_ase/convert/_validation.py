"""Validation beyond single fields: per-atom arrays, charges, the model's fit.

Elements the model knows, cells not too thin for its cutoff, and the keys that
are not carried (warned once per key).
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.constraints import FixAtoms
from ase.data import chemical_symbols

from nvalchemi_ase.convert._close_pairs import _heights
from nvalchemi_ase.convert._common import (
    _CARRIED_ARRAYS,
    _CARRIED_INFO,
    MAX_ATOMIC_NUMBER,
    MAX_PERIODIC_IMAGES,
    NotCarriedWarning,
    StructureError,
    _refuse_first_atom,
    _Stacked,
    _structure_of,
)
from nvalchemi_ase.convert._storage import _padded_cells

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
    _refuse_first_atom(
        ~np.isfinite(charges),
        ptr,
        "initial_charges",
        lambda bad: f"charge {charges[bad]} is not finite",
        "set finite charges in e (atoms.set_initial_charges)",
    )


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
    """Return the atomic numbers ``model`` can evaluate, None for any.

    None admits every element and ghost atoms ``X`` (Z = 0): the model does
    not index anything by atomic number (LJ, Ewald, PME). A composed model
    (nvalchemi's ``PipelineModelWrapper``) admits what all its parts admit.
    """
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
    return _parts_elements(model)


def _parts_elements(model: Any) -> frozenset[int] | None:
    """Return the elements all parts of a pipeline admit (None: any, or no pipeline)."""
    groups = getattr(model, "groups", None)
    if not isinstance(groups, list):
        return None
    parts = [step.model for group in groups for step in getattr(group, "steps", ())]
    declared = [
        elements for elements in map(_supported_elements, parts) if elements is not None
    ]
    return frozenset.intersection(*declared) if declared else None


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
    fix = (
        f"it supports {len(elements)} elements ({_element_ranges(elements)}); "
        "remove or replace those atoms, or use a model trained on them"
    )
    if number == 0:
        fix = (
            f"a ghost atom is no element for {name}, whose parameters are indexed "
            f"by atomic number (it has {_element_ranges(elements)}); remove the "
            "ghost atoms (del atoms[atoms.numbers == 0]), or use a model that "
            "reads no elements (e.g. 'lj')"
        )
    raise StructureError(
        structure,
        f"numbers[{atom}]",
        f"{name} cannot evaluate {', '.join(missing)} (atom {atom} is "
        f"{chemical_symbols[number]}, Z = {number})",
        fix,
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
