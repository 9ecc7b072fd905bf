"""``MDMin``: damped molecular-dynamics relaxation with velocity projection.

Each step of structure b, with forces F (frozen atoms' zero) and unit masses:

1. After the first step: half kick v ← v + ½ dt F, then keep only the part of
   v along F, v ← F (v·F)/(F·F), or v ← 0 if v·F < 0 (moving uphill).
2. Half kick v ← v + ½ dt F; displacement Δ = dt v.
3. If the longest atomic displacement exceeds ``maxstep``, scale Δ by
   ``maxstep / (1e-6 + longest)`` (the velocity is kept as it is).

This is the algorithm of ASE's ``MDMin``; the dot products are per structure.
Under ASE's ``UnitCellFilter``/``FrechetCellFilter`` (``cell_filter``) the step
acts on the filter's N + 3 rows (:mod:`~nvalchemi_ase.engines.cell_filter`),
the cell rows' velocities in the state's ``cell_velocities`` [B, 3, 3].
The velocity is ``batch.velocities`` (fictitious, unit mass), which
nvalchemi's base class already keeps for graphs with ``status >= exit_status``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from nvalchemi.data import Batch

from nvalchemi_ase._compat import post_update_is_noop
from nvalchemi_ase.engines._common import (
    PerGraphEngine,
    active_graphs,
    finite_positive,
    keep_inactive,
    make_state,
)
from nvalchemi_ase.engines._rows import Rows
from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ASEMDMin"]

#: Added to the longest displacement before dividing (ASE's guard), Å.
STEP_GUARD = 1e-6


@post_update_is_noop
class ASEMDMin(PerGraphEngine):
    """Batched MDMin relaxation (ASE's algorithm).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Fictitious time step with unit masses, in the internal (= ASE) time
        unit, as nvalchemi's optimizers take it (ASE's default 0.2).
    maxstep : float
        Largest atomic displacement per step, Å (ASE's default 0.2).
    cell_filter : CellFilterCoordinates, optional
        Relax in the coordinates of ASE's cell filters (cell included).
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook``, ...: see
        :class:`~nvalchemi_ase.engines._common.PerGraphEngine`.

    Notes
    -----
    State per structure: ``started`` [B] bool (the first step skips the
    projection), kept unchanged for graphs with ``status >= exit_status``.
    The velocities start from ``batch.velocities`` (zero for a fresh
    relaxation). The whole step happens in ``pre_update``.
    """

    __needs_keys__: set[str] = {"forces"}  # noqa: RUF012 - BaseDynamics types it set[str]
    __provides_keys__: set[str] = {"positions", "velocities"}  # noqa: RUF012
    samples_equilibrium: ClassVar[bool] = False

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float = 0.2,
        maxstep: float = 0.2,
        cell_filter: CellFilterCoordinates | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.dt = finite_positive("dt", dt)
        self.maxstep = finite_positive("maxstep (Å)", maxstep)
        self.cell_filter = cell_filter
        if cell_filter is not None:
            self.__needs_keys__ = {"forces", "stress"}
            self.__provides_keys__ = {"positions", "velocities", "cell"}

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(batch.num_graphs, batch)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        return self._new_state(n, template_batch)

    def _new_state(self, count: int, template: Batch) -> Batch:
        device = template.device
        fields = {"started": torch.zeros(count, dtype=torch.bool, device=device)}
        if self.cell_filter is not None:
            fields["cell_velocities"] = torch.zeros(
                count, 3, 3, dtype=template.positions.dtype, device=device
            )
        return make_state(fields, device)

    def pre_update(self, batch: Batch) -> None:
        """Project and kick the velocities, then move every structure.

        Parameters
        ----------
        batch : Batch
            ``velocities`` [V, 3] and ``positions`` [V, 3] Å updated in place
            from ``forces`` [V, 3] eV/Å.
        """
        state = self._state
        if state.num_graphs != batch.num_graphs:
            raise RuntimeError(
                f"ASEMDMin holds state for {state.num_graphs} graphs but the batch has "
                f"{batch.num_graphs}; build one engine per batch composition"
            )
        with torch.no_grad():
            rows = Rows(batch, self.cell_filter)
            active = active_graphs(self, batch)
            forces = rows.forces()
            half_kick = 0.5 * self.dt * forces
            kicked = rows.velocities(self._cell_velocities()) + half_kick
            along = rows.sum((kicked * forces).sum(dim=-1))
            squared = rows.sum((forces * forces).sum(dim=-1))
            factor = torch.where(
                (along > 0) & (squared > 0), along / squared, torch.zeros_like(along)
            )
            projected = forces * rows.spread(factor)
            started = rows.spread(state.started)
            velocities = torch.where(started, projected, 0.0) + half_kick
            displacement = self.dt * velocities
            longest = rows.max(displacement.norm(dim=-1))
            scale = (self.maxstep / (STEP_GUARD + longest)).clamp(0.0, 1.0)
            rows.set_velocities(velocities, self._cell_velocities(), active)
            rows.move(displacement * rows.spread(scale))
            keep_inactive(state.started, torch.ones_like(state.started), active)

    def _cell_velocities(self) -> torch.Tensor | None:
        """[B, 3, 3] velocities of the cell rows (state), None without a filter."""
        return None if self.cell_filter is None else self._state.cell_velocities

    def post_update(self, batch: Batch) -> None:
        """No-op: the next step uses the forces at the new positions."""
