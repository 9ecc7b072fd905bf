"""Stacked NumPy arrays -> ``Batch``, built on nvalchemi's level storages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert._common import (
    FROZEN_CATEGORY,
    _Stacked,
)

if TYPE_CHECKING:
    from nvalchemi.data import Batch


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
