"""``Batch`` -> host NumPy arrays -> ``Atoms`` (one device-to-host copy per field)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixAtoms
from ase.data import atomic_masses as ase_default_masses

from nvalchemi_ase.convert._common import (
    _ATOM_VECTORS,
    _CARRIED_INFO,
    FROZEN_CATEGORY,
)
from nvalchemi_ase.units import velocities_to_momenta

if TYPE_CHECKING:
    from nvalchemi.data import Batch


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


def _check_same_shape(
    atoms_list: list[Atoms], host: _HostCopy, chosen: Iterable[int] | None = None
) -> None:
    """Refuse a list that is not the batch's: its length, and the atom counts.

    ``chosen``: check the atom counts of these structures only (those written).
    """
    if len(atoms_list) != host.num_graphs:
        raise ValueError(
            f"update_atoms got {len(atoms_list)} structures for a batch of "
            f"{host.num_graphs} graphs; pass the list the batch was built from"
        )
    counts = np.diff(host.ptr)
    indices = range(len(atoms_list)) if chosen is None else chosen
    for index in indices:
        atoms = atoms_list[index]
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
