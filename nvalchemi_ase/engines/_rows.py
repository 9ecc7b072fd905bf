"""The rows an optimizer engine moves: the atoms, plus 3 cell rows under a filter.

ASE's optimizers act on ``optimizable.get_x()``: the N atom rows of a
structure, or the N + 3 rows of a cell filter (see
:mod:`nvalchemi_ase.engines.cell_filter`). :class:`Rows` gives FIRE, BFGS and
MDMin one view of either: ``R`` rows ([V, 3] atoms first, then [3B, 3] cell
rows, three per structure in batch order), each with its structure index,
and per-structure sums and maxima over them.
"""

from __future__ import annotations

import torch
from nvalchemi.data import Batch

from nvalchemi_ase.engines._common import free_atoms, keep_inactive
from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

__all__ = ["Rows"]


class Rows:
    """Generalized coordinates of a batch, with or without ASE's cell filter.

    Parameters
    ----------
    batch : Batch
        The batch (``positions``, ``forces``; ``cell``, ``stress`` and
        ``energy`` under a filter).
    cell_filter : CellFilterCoordinates or None
        The filters' coordinates; None: the atoms only.
    """

    def __init__(self, batch: Batch, cell_filter: CellFilterCoordinates | None):
        self.batch, self.cell_filter = batch, cell_filter
        self.count = batch.num_graphs
        self.atoms = batch.num_nodes
        graph = batch.batch_idx.long()
        if cell_filter is not None:
            structures = torch.arange(self.count, device=graph.device)
            graph = torch.cat([graph, structures.repeat_interleave(3)])
        #: [R] structure of every row.
        self.graph = graph

    def free(self) -> torch.Tensor:
        """[R] bool: rows that may move (frozen atoms' do not; cell rows do)."""
        free = free_atoms(self.batch)
        if self.cell_filter is None:
            return free
        return torch.cat([free, free.new_ones(3 * self.count)])

    def positions(self) -> torch.Tensor:
        """[R, 3] positions (Å; the filter's under a filter)."""
        if self.cell_filter is None:
            return self.batch.positions.detach()
        atoms, cell = self.cell_filter.positions(self.batch)
        return self.join(atoms, cell)

    def forces(self) -> torch.Tensor:
        """[R, 3] forces, eV/Å (frozen atoms' zero; the filter's under a filter)."""
        batch = self.batch
        free = free_atoms(batch).unsqueeze(-1)
        forces = torch.where(free, batch.forces.detach(), 0.0)
        if self.cell_filter is None:
            return forces
        return self.join(*self.cell_filter.forces(batch, forces))

    def energy(self) -> torch.Tensor:
        """[B] energy, eV (the filter's ``E + p V`` under a filter)."""
        if self.cell_filter is None:
            return self.batch.energy.detach().reshape(-1)
        return self.cell_filter.energy(self.batch)

    def set_positions(self, positions: torch.Tensor) -> None:
        """Write [R, 3] positions into the batch (and the cell, under a filter)."""
        if self.cell_filter is None:
            self.batch.positions.copy_(positions)
            return
        atoms, cell = self.split(positions)
        self.cell_filter.set_positions(self.batch, atoms, cell)

    def move(self, step: torch.Tensor) -> None:
        """Add a [R, 3] step to the positions (ASE's ``set_x(get_x() + step)``)."""
        if self.cell_filter is None:
            self.batch.positions.add_(step)
            return
        self.set_positions(self.positions() + step)

    def velocities(self, cell_velocities: torch.Tensor | None) -> torch.Tensor:
        """[R, 3] velocities: the batch's, then ``cell_velocities`` [B, 3, 3]."""
        velocities = self.batch.velocities.detach()
        if cell_velocities is None:
            return velocities
        return self.join(velocities, cell_velocities)

    def set_velocities(
        self,
        velocities: torch.Tensor,
        cell_velocities: torch.Tensor | None,
        active: torch.Tensor | None,
    ) -> None:
        """Write [R, 3] velocities: atom rows to the batch, cell rows in place."""
        if cell_velocities is None:
            self.batch.velocities.copy_(velocities)
            return
        atoms, cell = self.split(velocities)
        self.batch.velocities.copy_(atoms)
        keep_inactive(cell_velocities, cell, active)

    def join(self, atoms: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """[R, 3] rows from atom rows [V, 3] and cell rows [B, 3, 3]."""
        return torch.cat([atoms, cell.reshape(-1, 3)])

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Atom rows [V, 3] and cell rows [B, 3, 3] of [R, 3] rows."""
        return rows[: self.atoms], rows[self.atoms :].reshape(-1, 3, 3)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-structure sum of [R] values, [B]."""
        return values.new_zeros(self.count).index_add_(0, self.graph, values)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-structure maximum of non-negative [R] values, [B]."""
        largest = values.new_zeros(self.count)
        return largest.scatter_reduce_(0, self.graph, values, reduce="amax")

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """[R, 1] per-row copy of per-structure [B] values."""
        return values[self.graph].unsqueeze(-1)

    def local(self) -> torch.Tensor:
        """[R] row number within its structure (atoms 0..N-1, cell rows N..N+2)."""
        batch = self.batch
        index = batch.batch_idx.long()
        start = batch.batch_ptr.long()
        local = torch.arange(self.atoms, device=index.device) - start[index]
        if self.cell_filter is None:
            return local
        counts = start[1:] - start[:-1]
        cell = counts.repeat_interleave(3) + torch.arange(
            3, device=index.device
        ).repeat(self.count)
        return torch.cat([local, cell])
