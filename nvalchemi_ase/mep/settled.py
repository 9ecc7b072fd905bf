"""Images that no longer move cost no model work: band endpoints, converged paths.

nvalchemi's NEB engine evaluates the whole batch at every step, the two fixed
endpoints of every band included, so a 5-image band costs 5/3 of the model
work of ASE's NEB, which reads the endpoints' results once. And a path that
has converged stays in the batch, evaluated at every step until the last path
is done. :class:`SettledImages` is an engine hook that removes that work and
keeps every number the engine sees:

* after the first evaluation it keeps each endpoint's energy and forces and
  gives the endpoints' atoms empty neighbour rows
  (:func:`~nvalchemi_ase.dynamics.neighbors.empty_neighbors`, as the
  relaxation runner does for finished structures), so the model spends next
  to nothing on them; after every later evaluation it writes the kept results
  back before nvalchemi's NEB hooks read them, so energies, tangents, springs
  and the climbing image are those of a full evaluation;
* on a CPU, the images of a path that graduated get empty rows too (their
  results are final and no hook reads them again). On an accelerator this is
  left out: finding them would synchronise with the host at every step;
* it keeps the model's energy and forces of every image from its last full
  evaluation (the engine's ``batch.forces`` hold NEB forces), at the positions
  the run ends with, so the final results need no model call.

Register it before nvalchemi's path hooks (with the neighbour-list hooks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import batch_results
from nvalchemi_ase.dynamics.neighbors import empty_neighbors

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["SettledImages"]


class SettledImages:
    """An engine hook keeping the results of images that no longer move.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        The grouped batch of the run (graph ``j`` of path ``p`` is image ``j``).
    neighbor_hooks : list
        The engine's neighbour-list hooks (made by
        :func:`~nvalchemi_ase.dynamics.neighbors.neighbor_hooks`); their lists
        lose the rows of settled images. Without any, every image is still
        evaluated and the kept results are written back all the same.

    Attributes
    ----------
    endpoints : torch.Tensor
        [B] bool: the first and last image of every path.
    emptied : torch.Tensor
        [B] bool: images whose neighbour rows are empty.
    stage : None
        nvalchemi's dispatch goes through ``_runs_on_stage``
        (``AFTER_COMPUTE`` and ``ON_GRADUATE``).
    """

    frequency = 1
    stage = None

    def __init__(self, batch: Batch, neighbor_hooks: list[Any]) -> None:
        stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
        self._after_compute = stages.AFTER_COMPUTE
        self._on_graduate = stages.ON_GRADUATE
        self._neighbor_hooks = list(neighbor_hooks)
        self._atom_graph = batch.batch_idx.long()  # [V]
        ptr = batch.group_layout.group_ptr.long()  # [P + 1]
        self.endpoints = torch.zeros(
            batch.num_graphs, dtype=torch.bool, device=batch.device
        )
        self.endpoints[ptr[:-1]] = True
        self.endpoints[ptr[1:] - 1] = True
        self.emptied = torch.zeros_like(self.endpoints)
        self._empty_graduated = batch.device.type == "cpu"
        self._energy: torch.Tensor | None = None  # [B, 1] eV
        self._forces: torch.Tensor | None = None  # [V, 3] eV/Å

    def _runs_on_stage(self, stage: Any) -> bool:
        return stage in (self._after_compute, self._on_graduate)

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Keep or restore results after an evaluation; empty settled images."""
        if stage == self._after_compute:
            self._after_evaluation(ctx.batch, ctx.active_graph_mask)
        elif stage == self._on_graduate and self._empty_graduated:
            graduated = ctx.graduated_mask
            if graduated is not None and bool(graduated.any()):  # free on a CPU
                self._empty(ctx.batch, graduated.to(torch.bool))

    def _after_evaluation(self, batch: Batch, active: torch.Tensor | None) -> None:
        with torch.no_grad():
            energy, forces = batch.energy.detach(), batch.forces.detach()
            if self._energy is None or self._forces is None:  # the first evaluation
                self._energy, self._forces = energy.clone(), forces.clone()
                self._empty(batch, self.endpoints)
                return
            fresh = ~self.emptied
            if active is not None:
                fresh = fresh & active.view(-1)[: fresh.numel()].to(torch.bool)
            self._keep(self._energy, energy, fresh)
            self._keep(self._forces, forces, fresh[self._atom_graph])
            restored = self.endpoints & self.emptied
            self._keep(energy, self._energy, restored)
            self._keep(forces, self._forces, restored[self._atom_graph])

    @staticmethod
    def _keep(target: torch.Tensor, source: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy the ``rows`` [N] of ``source`` into ``target`` ([N, ...]), in place."""
        target.copy_(
            torch.where(rows.view(-1, *([1] * (target.dim() - 1))), source, target)
        )

    def _empty(self, batch: Batch, graphs: torch.Tensor) -> None:
        """Give the atoms of ``graphs`` [B] (not emptied before) no neighbours."""
        new = graphs & ~self.emptied
        self.emptied |= new
        empty_neighbors(self._neighbor_hooks, batch, new)

    def results(self, batch: Batch) -> list[dict[str, Any]]:
        """Return the model's results of every image at its last full evaluation.

        Parameters
        ----------
        batch : nvalchemi.data.Batch
            The batch after the run (the engine has evaluated it at least once).

        Returns
        -------
        list of dict
            One ASE results dict per image (energy eV, forces eV/Å), in batch
            order: at the positions the run ended with, for every image that
            did not fail.
        """
        if self._energy is None or self._forces is None:
            raise RuntimeError("the engine has not evaluated the batch yet")
        return batch_results(batch, {"energy": self._energy, "forces": self._forces})
