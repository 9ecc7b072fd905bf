"""Unwrapped positions under periodic boundaries, for displacements and MSDs.

An MD engine may wrap atoms back into the cell; a displacement across the
boundary then looks like a jump of a lattice vector. Between two samples every
atom is assumed to move less than half a cell width along each periodic axis,
so the jump is the nearest lattice vector of the fractional displacement::

    n_t = round(s_t - s_{t-1})                (periodic axes only, s fractional)
    u_t = u_{t-1} + (r_t - r_{t-1}) - n_t · cell_t

with ``u_0 = r_0``. For a fixed cell this is exact; for a changing cell (NPT)
it keeps each step's true Cartesian displacement and removes only the wraps.
Sample often enough that no atom moves half a cell between samples.
"""

from __future__ import annotations

import torch

__all__ = ["Unwrapper", "unwrap_positions"]


def unwrap_positions(
    positions: torch.Tensor, cells: torch.Tensor, pbc: torch.Tensor
) -> torch.Tensor:
    """Unwrap a whole trajectory of one structure.

    Parameters
    ----------
    positions : torch.Tensor, shape (T, N, 3)
        Cartesian positions, Å, possibly wrapped.
    cells : torch.Tensor, shape (T, 3, 3)
        The cell at each frame (rows are lattice vectors, invertible), Å.
    pbc : torch.Tensor, shape (3,), bool
        Periodic axes.

    Returns
    -------
    torch.Tensor, shape (T, N, 3), float64
        Positions with the boundary wraps removed, Å (frame 0 unchanged).
    """
    positions = positions.to(torch.float64)
    cells = cells.to(torch.float64)
    frac = torch.einsum("tni,tij->tnj", positions, torch.linalg.inv(cells))
    jumps = _jumps(frac[1:] - frac[:-1], pbc)
    steps = positions[1:] - positions[:-1]
    moves = steps - torch.einsum("tni,tij->tnj", jumps, cells[1:])
    zero = torch.zeros_like(positions[:1])
    return positions[:1] + torch.cumsum(torch.cat([zero, moves]), dim=0)


def _jumps(frac_step: torch.Tensor, pbc: torch.Tensor) -> torch.Tensor:
    """Lattice-vector jumps (cell units) of fractional steps, periodic axes only."""
    periodic = pbc.to(device=frac_step.device, dtype=torch.bool)
    return torch.where(periodic, torch.round(frac_step), torch.zeros_like(frac_step))


class Unwrapper:
    """Unwrap the positions of a batch sample by sample (the same rule, streamed).

    Parameters
    ----------
    pbc : torch.Tensor, shape (B, 3), bool
        Periodic axes of each structure.
    structure_of_atom : torch.Tensor, shape (M,), long
        Structure of each atom.
    """

    def __init__(self, pbc: torch.Tensor, structure_of_atom: torch.Tensor) -> None:
        self.structure_of_atom = structure_of_atom.long()
        self.pbc = pbc.to(torch.bool)[self.structure_of_atom]
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._unwrapped: torch.Tensor | None = None

    def update(self, positions: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        """Take the next sample and return its unwrapped positions.

        Parameters
        ----------
        positions : torch.Tensor, shape (M, 3)
            Cartesian positions, Å.
        cells : torch.Tensor, shape (B, 3, 3)
            Each structure's cell, Å.

        Returns
        -------
        torch.Tensor, shape (M, 3), float64
            Unwrapped positions, Å (a new tensor).
        """
        positions = positions.detach().to(torch.float64)
        cells = cells.detach().to(torch.float64)
        index = self.structure_of_atom
        frac = torch.einsum("mi,mij->mj", positions, torch.linalg.inv(cells)[index])
        if self._last is None or self._unwrapped is None:
            self._unwrapped = positions.clone()
        else:
            before, frac_before = self._last
            jumps = _jumps(frac - frac_before, self.pbc)
            self._unwrapped = (
                self._unwrapped
                + (positions - before)
                - torch.einsum("mi,mij->mj", jumps, cells[index])
            )
        self._last = (positions.clone(), frac)
        return self._unwrapped.clone()
