"""The options of ASE's cell filters on nvalchemi's variable-cell optimizers.

ASE's ``FrechetCellFilter`` and ``UnitCellFilter`` turn the stress σ into the
force on the cell through a virial ``W = -V σ`` that their options change
(``ase/filters.py``, ``get_forces``), in this order:

* ``scalar_pressure`` p (eV/Å³): ``σ → σ + p 1`` (the cell relaxes to pressure p);
* ``hydrostatic_strain``: ``σ → (tr σ / 3) 1`` (the shape is kept);
* ``mask`` (3×3 of 0/1, from ASE's Voigt mask): ``σ → σ ∘ mask`` (masked
  cell components do not move);
* ``constant_volume``: ``σ → σ - (tr σ / 3) 1`` (deviatoric only).

nvalchemi's variable-cell engines read ``batch.stress`` for their cell step
(in ``pre_update``), so the effective stress is put into the batch just for
that call and the model's stress back after it: results, trajectories and
``atoms.get_stress()`` keep the physical stress, as ASE's ``Atoms`` do, while
convergence (``fmax`` over atom and cell rows) uses the effective one, as
ASE's filters do. With ``constant_volume`` each cell update is also rescaled
(with the positions) to keep its volume, which ASE's exponential (Fréchet)
update keeps by construction; likewise every cell step is projected onto the
deformations the options allow (``_project_cell_step``), because nvalchemi's
``FIRE2VariableCell`` moves the cell vectors themselves, and a hydrostatic
stress then still changes a non-cubic cell's shape. A mask acts on the
batch's cell components, which are the user's only for cells nvalchemi need
not rotate (lower-triangular ones, e.g. orthorhombic cells on the axes); for
other cells a mask is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nvalchemi_ase.dynamics.hooks import StageHook

if TYPE_CHECKING:
    from nvalchemi.data import Batch

    from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

__all__ = ["FilterOptions", "filter_coordinates", "filter_options"]


@dataclass
class FilterOptions:
    """Per-structure options of the cell filters, on the device.

    Attributes
    ----------
    pressure : torch.Tensor
        [B] ``scalar_pressure``, eV/Å³.
    hydrostatic : torch.Tensor
        [B] bool ``hydrostatic_strain``.
    constant_volume : torch.Tensor
        [B] bool.
    mask : torch.Tensor
        [B, 3, 3] 0/1 cell components that move.
    """

    pressure: torch.Tensor
    hydrostatic: torch.Tensor
    constant_volume: torch.Tensor
    mask: torch.Tensor

    def effective_stress(self, stress: torch.Tensor) -> torch.Tensor:
        """Return the stress ASE's filter makes the cell force of, [B, 3, 3] eV/Å³.

        Parameters
        ----------
        stress : torch.Tensor
            [B, 3, 3] model stress, eV/Å³ (tensile positive).

        Returns
        -------
        torch.Tensor
            [B, 3, 3] effective stress.
        """
        identity = torch.eye(3, dtype=stress.dtype, device=stress.device)
        stress = stress + self.pressure.view(-1, 1, 1) * identity
        trace = stress.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1) / 3.0
        stress = torch.where(self.hydrostatic.view(-1, 1, 1), trace * identity, stress)
        stress = stress * self.mask
        trace = stress.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1) / 3.0
        deviatoric = stress - trace * identity
        return torch.where(self.constant_volume.view(-1, 1, 1), deviatoric, stress)

    def hooks(self, stages: Any) -> list[Any]:
        """Hooks swapping the stress around the engine's update (``DynamicsStage``).

        Parameters
        ----------
        stages : nvalchemi.dynamics.base.DynamicsStage
            The stage enumeration.

        Returns
        -------
        list
            Two hooks: before and after ``pre_update``.
        """
        saved: dict[str, torch.Tensor] = {}

        def before(batch: Batch) -> None:
            saved["stress"] = batch.stress.detach().clone()
            saved["cell"] = batch.cell.detach().clone()
            with torch.no_grad():
                batch.stress.copy_(self.effective_stress(saved["stress"]))

        def after(batch: Batch) -> None:
            with torch.no_grad():
                batch.stress.copy_(saved["stress"])
                self._project_cell_step(batch, saved["cell"])

        return [
            StageHook(stages.BEFORE_PRE_UPDATE, before),
            StageHook(stages.AFTER_PRE_UPDATE, after),
        ]

    def _project_cell_step(self, batch: Batch, old_cell: torch.Tensor) -> None:
        """Keep only the cell deformation the options allow, atoms following.

        With ``L' = L G^T`` (ASE's deformation gradient G): ``hydrostatic``
        keeps ``det(G)^(1/3) 1``, a mask keeps ``1 + (G - 1) ∘ mask``,
        ``constant_volume`` divides by ``det(G)^(1/3)``. (An engine whose cell
        force comes from the effective stress already steps this way up to
        rounding; one whose cell coordinates are the cell vectors does not.)
        Fractional coordinates are kept.
        """
        new_cell = batch.cell.detach()
        identity = torch.eye(3, dtype=new_cell.dtype, device=new_cell.device)
        gradient = torch.linalg.solve(old_cell, new_cell).mT  # L^-1 L' = G^T
        determinant = torch.linalg.det(gradient)
        isotropic = determinant.abs().pow(1.0 / 3.0).view(-1, 1, 1) * identity
        gradient = torch.where(self.hydrostatic.view(-1, 1, 1), isotropic, gradient)
        gradient = identity + (gradient - identity) * self.mask
        scale = torch.linalg.det(gradient).abs().pow(1.0 / 3.0).view(-1, 1, 1)
        gradient = torch.where(
            self.constant_volume.view(-1, 1, 1), gradient / scale, gradient
        )
        cell = old_cell @ gradient.mT
        index = batch.batch_idx.long()
        fractional = torch.einsum(
            "va,vab->vb", batch.positions.detach(), torch.linalg.inv(new_cell)[index]
        )
        batch.positions.copy_(torch.einsum("va,vab->vb", fractional, cell[index]))
        batch.cell.copy_(cell)


def filter_options(
    filters: Sequence[Any], batch: Batch, alignment: np.ndarray
) -> FilterOptions | None:
    """Read the options of ASE cell filters; None when all are the defaults.

    Parameters
    ----------
    filters : sequence of FrechetCellFilter or UnitCellFilter
        One filter per structure, in batch order.
    batch : nvalchemi.data.Batch
        The aligned batch (device, dtype, cells).
    alignment : numpy.ndarray
        [B, 3, 3] rotations the batch's cells were given (identity: none).

    Returns
    -------
    FilterOptions or None

    Raises
    ------
    ValueError
        For a mask on a structure whose cell had to be rotated, or a
        ``StrainFilter`` (only the engines of FIRE, BFGS, MDMin run it).
    """
    if any(not hasattr(f, "scalar_pressure") for f in filters):
        raise ValueError(
            "StrainFilter is run by FIRE, BFGS and MDMin (ASE's filter coordinates); "
            "this optimizer's nvalchemi variable-cell engine moves the atoms too. "
            "Use FIRE, BFGS or MDMin, or UnitCellFilter/FrechetCellFilter"
        )
    pressure = np.array([float(f.scalar_pressure) for f in filters])
    hydrostatic = np.array([bool(f.hydrostatic_strain) for f in filters])
    constant = np.array([bool(f.constant_volume) for f in filters])
    masks = np.stack(
        [np.asarray(f.mask, dtype=np.float64).reshape(3, 3) for f in filters]
    )
    masked = (masks != 1.0).reshape(len(filters), -1).any(axis=1)
    if not (pressure.any() or hydrostatic.any() or constant.any() or masked.any()):
        return None
    for index in np.flatnonzero(masked):
        if not np.allclose(alignment[index], np.eye(3), atol=1e-12):
            raise ValueError(
                f"images[{index}]: a cell-filter mask acts on cell components, and "
                "this cell is not lower-triangular (nvalchemi's variable-cell "
                "engines would rotate it); use a cell with a along x and b in the "
                "xy plane (atoms.set_cell(atoms.cell.standard_form()[0], "
                "scale_atoms=True)) or no mask"
            )
    device, dtype = batch.positions.device, batch.positions.dtype

    def tensor(values: np.ndarray, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.as_tensor(values, dtype=kind, device=device)

    return FilterOptions(
        pressure=tensor(pressure),
        hydrostatic=tensor(hydrostatic, torch.bool),
        constant_volume=tensor(constant, torch.bool),
        mask=tensor(masks),
    )


def filter_coordinates(
    filters: Sequence[Any], kind: str, batch: Batch
) -> CellFilterCoordinates:
    """ASE's filter coordinates for this package's engines (FIRE, BFGS, MDMin).

    Unlike nvalchemi's variable-cell engines these move the filter's own
    N + 3 rows (:mod:`nvalchemi_ase.engines.cell_filter`), in the user's
    frame: every option, masks included, acts as in ASE.

    Parameters
    ----------
    filters : sequence of FrechetCellFilter, UnitCellFilter or StrainFilter
        One filter per structure, in batch order.
    kind : str
        ``"FrechetCellFilter"``, ``"UnitCellFilter"`` or ``"StrainFilter"``.
    batch : nvalchemi.data.Batch
        The batch (device, dtype).

    Returns
    -------
    CellFilterCoordinates
    """
    from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

    device, dtype = batch.positions.device, batch.positions.dtype

    def tensor(values: Any, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), dtype=kind, device=device)

    if kind == "StrainFilter":
        return _strain_coordinates(filters, tensor)
    frechet = kind == "FrechetCellFilter"
    cell_factor = [float(f.cell_factor) for f in filters]
    return CellFilterCoordinates(
        frechet=frechet,
        reference=tensor(np.stack([np.asarray(f.orig_cell) for f in filters])),
        cell_factor=tensor(cell_factor),
        exp_cell_factor=tensor(
            [float(f.exp_cell_factor) for f in filters] if frechet else cell_factor
        ),
        atom_count=tensor([float(len(f.atoms)) for f in filters]),
        pressure=tensor([float(f.scalar_pressure) for f in filters]),
        hydrostatic=tensor([bool(f.hydrostatic_strain) for f in filters], torch.bool),
        constant_volume=tensor([bool(f.constant_volume) for f in filters], torch.bool),
        mask=tensor(np.stack([np.asarray(f.mask, dtype=np.float64) for f in filters])),
    )


def _strain_coordinates(filters: Sequence[Any], tensor: Any) -> CellFilterCoordinates:
    """ASE's ``StrainFilter`` (only the cell moves) as filter coordinates."""
    from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

    count = len(filters)
    masks = [
        np.concatenate([np.asarray(f.mask, dtype=np.float64).ravel(), np.zeros(3)])
        for f in filters
    ]
    ones = tensor(np.ones(count))
    return CellFilterCoordinates(
        frechet=False,
        reference=tensor(np.stack([np.asarray(f.origcell) for f in filters])),
        cell_factor=ones,
        exp_cell_factor=ones,
        atom_count=tensor([float(len(f.atoms)) for f in filters]),
        pressure=tensor(np.zeros(count)),
        hydrostatic=tensor(np.zeros(count, dtype=bool), torch.bool),
        constant_volume=tensor(np.zeros(count, dtype=bool), torch.bool),
        mask=tensor(np.stack(masks).reshape(count, 3, 3)),
        strain=True,
    )
