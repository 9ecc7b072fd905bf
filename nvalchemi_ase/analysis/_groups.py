"""Rows of a series grouped per structure and element; centre-of-mass removal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from ase.data import chemical_symbols

__all__ = ["ElementGroups", "element_groups", "subtract_center_of_mass"]


@dataclass(frozen=True)
class ElementGroups:
    """Which (structure, element) group every atom of a batch belongs to.

    Attributes
    ----------
    of_atom : torch.Tensor, shape (M,), long
        Group index of each atom.
    structure_of_atom : torch.Tensor, shape (M,), long
        Structure index of each atom.
    structure : numpy.ndarray, shape (G,), int
        Structure of each group (groups of a structure are contiguous, ordered
        by atomic number).
    symbol : list of str
        Element of each group.
    size : numpy.ndarray, shape (G,), float
        Atoms in each group.
    """

    of_atom: torch.Tensor
    structure_of_atom: torch.Tensor
    structure: npt.NDArray[np.int64]
    symbol: list[str]
    size: npt.NDArray[np.float64]

    @property
    def count(self) -> int:
        """Number of groups G."""
        return len(self.symbol)

    def of_structure(self, index: int) -> npt.NDArray[np.int64]:
        """Group indices of structure ``index``."""
        return np.flatnonzero(self.structure == index)


def element_groups(
    numbers: Sequence[npt.NDArray[np.integer]], device: torch.device | str = "cpu"
) -> ElementGroups:
    """Group the atoms of consecutive structures by structure and element.

    Parameters
    ----------
    numbers : sequence of numpy.ndarray, each shape (N_i,)
        Atomic numbers of each structure, in the order the atoms are stacked.
    device : torch.device or str
        Device of the index tensors.

    Returns
    -------
    ElementGroups
        The grouping.
    """
    of_atom: list[npt.NDArray[np.int64]] = []
    structure_of_atom: list[npt.NDArray[np.int64]] = []
    structure: list[int] = []
    symbol: list[str] = []
    size: list[int] = []
    offset = 0
    for index, values in enumerate(numbers):
        values = np.asarray(values)
        unique, inverse, counts = np.unique(
            values, return_inverse=True, return_counts=True
        )
        of_atom.append(inverse + offset)
        structure_of_atom.append(np.full(len(values), index))
        structure.extend([index] * len(unique))
        symbol.extend(chemical_symbols[int(z)] for z in unique)
        size.extend(counts.tolist())
        offset += len(unique)
    return ElementGroups(
        of_atom=torch.as_tensor(np.concatenate(of_atom), device=device),
        structure_of_atom=torch.as_tensor(
            np.concatenate(structure_of_atom), device=device
        ),
        structure=np.asarray(structure, dtype=np.int64),
        symbol=symbol,
        size=np.asarray(size, dtype=np.float64),
    )


def subtract_center_of_mass(
    values: torch.Tensor,
    masses: torch.Tensor,
    structure_of_atom: torch.Tensor,
    n_structures: int,
) -> torch.Tensor:
    """Remove each structure's mass-weighted mean (centre-of-mass drift).

    Parameters
    ----------
    values : torch.Tensor, shape (..., M, 3)
        Positions (Å) or velocities (Å/ASE-time) of the atoms of a batch.
    masses : torch.Tensor, shape (M,)
        Masses, amu.
    structure_of_atom : torch.Tensor, shape (M,), long
        Structure of each atom.
    n_structures : int
        Number of structures.

    Returns
    -------
    torch.Tensor, shape (..., M, 3)
        ``values`` minus its structure's centre-of-mass value.
    """
    weights = masses.to(values.dtype)
    weighted = values * weights[:, None]
    shape = (*values.shape[:-2], n_structures, 3)
    sums = values.new_zeros(shape).index_add_(-2, structure_of_atom, weighted)
    total = values.new_zeros(n_structures).index_add_(0, structure_of_atom, weights)
    center = sums / total[:, None]
    return values - center.index_select(-2, structure_of_atom)
