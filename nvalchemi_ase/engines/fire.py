"""``FIRE``: ASE's FIRE (Bitzek et al. 2006, as ``ase.optimize.FIRE`` has it), batched.

nvalchemi 0.3's ``FIRE`` engine integrates with the atomic masses, caps each
atom's step and restarts differently, so its paths differ from ASE's (and took
42 % more steps on a set of argon structures). This engine is ASE's algorithm
with every sum taken per structure. Each step of structure b, with forces F
(frozen atoms' zero) and unit masses, on ``batch.velocities`` v:

1. First step: v = 0. Later steps: with ``downhill_check``, if the energy rose
   since the previous step, the positions go back to those of the previous
   step (F stays the force at the uphill positions, as in ASE). Then, with
   ``P = F·v`` and unless the step was uphill: if P > 0,
   ``v ← (1 - a) v + a |v| F/|F|``, and after more than ``Nmin`` such steps
   ``dt ← min(dt · finc, dtmax)``, ``a ← a · fa``; otherwise v = 0,
   ``a = astart``, ``dt ← dt · fdec`` and the count restarts.
2. ``v ← v + dt F``; ``Δ = dt v``; if ``|Δ|`` (the whole structure's, as ASE)
   exceeds ``maxstep``, ``Δ ← maxstep Δ/|Δ|``; ``x ← x + Δ``.

Under ASE's ``UnitCellFilter``/``FrechetCellFilter`` (``cell_filter``) the
same step acts on the filter's N + 3 rows (:mod:`~nvalchemi_ase.engines.cell_filter`):
forces, velocities, norms and ``maxstep`` over atom and cell rows, the energy
of ``downhill_check`` the filter's ``E + p V``; the cell rows' velocities are
``cell_velocities`` [B, 3, 3] in the state.

The whole step happens in ``pre_update``, from the forces of the previous
evaluation. State per structure: ``dt``, ``a`` [B], ``count`` [B] (ASE's
``Nsteps``), ``started`` [B] bool and, with ``downhill_check``, ``last_energy``
[B] eV; the positions of the previous step are kept per atom on the engine
(``previous_positions``). Rows of structures with ``status >= exit_status``
are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from nvalchemi.data import Batch

from nvalchemi_ase._compat import post_update_is_noop
from nvalchemi_ase.engines._common import (
    PerGraphEngine,
    active_graphs,
    finite_positive,
    fire_state,
    keep_inactive,
)
from nvalchemi_ase.engines._rows import Rows
from nvalchemi_ase.engines.cell_filter import CellFilterCoordinates

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ASEFIRE", "ResetCallback"]

#: Called when structures went uphill (``downhill_check``), before they go
#: back: ``(uphill [B] bool, previous_positions [V, 3] Å, energy [B] eV,
#: last_energy [B] eV)``. Setting one costs a host read per step.
ResetCallback = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@post_update_is_noop
class ASEFIRE(PerGraphEngine):
    """Batched FIRE with ASE's arithmetic (``ase.optimize.FIRE``).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt : float
        Initial time step, internal (= ASE) time units, unit masses.
    maxstep : float
        Largest step of a structure (norm over all its atoms), Å.
    dtmax : float
        Largest time step.
    n_min : int
        Downhill steps before the time step grows (ASE's ``Nmin``).
    finc, fdec : float
        Time-step growth and shrink factors.
    astart, fa : float
        Initial mixing parameter and its decay factor.
    a : float
        Mixing parameter of the first steps (ASE's ``a``; usually ``astart``).
    downhill_check : bool
        Go back to the previous positions when the energy rose.
    cell_filter : CellFilterCoordinates, optional
        Relax in the coordinates of ASE's cell filters (cell included).
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook``, ...: see
        :class:`~nvalchemi_ase.engines._common.PerGraphEngine`.
    """

    __needs_keys__: set[str] = {"forces"}  # noqa: RUF012 - BaseDynamics types it set[str]
    __provides_keys__: set[str] = {"positions", "velocities"}  # noqa: RUF012
    samples_equilibrium: ClassVar[bool] = False

    def __init__(
        self,
        model: BaseModelMixin,
        dt: float = 0.1,
        maxstep: float = 0.2,
        dtmax: float = 1.0,
        n_min: int = 5,
        finc: float = 1.1,
        fdec: float = 0.5,
        astart: float = 0.1,
        fa: float = 0.99,
        a: float = 0.1,
        downhill_check: bool = False,
        cell_filter: CellFilterCoordinates | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.dt = finite_positive("dt", dt)
        self.maxstep = finite_positive("maxstep (Å)", maxstep)
        self.dtmax = finite_positive("dtmax", dtmax)
        self.n_min = int(n_min)
        self.finc, self.fdec = float(finc), float(fdec)
        self.astart, self.fa, self.a = float(astart), float(fa), float(a)
        self.downhill_check = bool(downhill_check)
        self.cell_filter = cell_filter
        if self.downhill_check:
            self.__needs_keys__ = {"forces", "energy"}
        if cell_filter is not None:
            self.__needs_keys__ = self.__needs_keys__ | {"stress"}
            self.__provides_keys__ = {"positions", "velocities", "cell"}
        self.previous_positions: torch.Tensor | None = None
        #: [B, 3, 3] cells of the previous step (``downhill_check`` with a filter).
        self.previous_cell: torch.Tensor | None = None
        #: Optional :data:`ResetCallback` (ASE's ``position_reset_callback``).
        self.reset_callback: ResetCallback | None = None

    # -- state ------------------------------------------------------------------

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(batch.num_graphs, batch)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        return self._new_state(n, template_batch)

    def _new_state(self, count: int, template: Batch) -> Batch:
        return fire_state(
            count,
            template,
            dt=self.dt,
            a=self.a,
            cell_rows=self.cell_filter is not None,
            last_energy=self.downhill_check,
        )

    # -- the step ---------------------------------------------------------------

    def pre_update(self, batch: Batch) -> None:
        """One FIRE step of every structure (see the module docstring).

        Parameters
        ----------
        batch : Batch
            ``velocities`` [V, 3] and ``positions`` [V, 3] Å updated in place
            from ``forces`` [V, 3] eV/Å (and ``energy`` [B, 1] eV with
            ``downhill_check``).
        """
        state = self._state
        if state.num_graphs != batch.num_graphs:
            raise RuntimeError(
                f"ASEFIRE holds state for {state.num_graphs} graphs but the batch has "
                f"{batch.num_graphs}; build one engine per batch composition"
            )
        with torch.no_grad():
            rows = Rows(batch, self.cell_filter)
            active = active_graphs(self, batch)
            forces = rows.forces()
            velocities = rows.velocities(self._cell_velocities())
            started = state.started
            uphill = self._go_back_if_uphill(batch, rows, started, active)
            power = rows.sum((forces * velocities).sum(dim=-1))
            squared = rows.sum((forces * forces).sum(dim=-1))
            speed = rows.sum((velocities * velocities).sum(dim=-1)).sqrt()
            downhill = (power > 0) & ~uphill
            mixed = (
                rows.spread(1.0 - state.a) * velocities
                + rows.spread(state.a * speed / squared.sqrt().clamp_min(1e-300))
                * forces
            )
            grow = downhill & (state.count > self.n_min)
            dt = torch.where(
                started,
                torch.where(
                    downhill,
                    torch.where(
                        grow, (state.dt * self.finc).clamp_max(self.dtmax), state.dt
                    ),
                    state.dt * self.fdec,
                ),
                state.dt,
            )
            a = torch.where(
                started,
                torch.where(
                    downhill,
                    torch.where(grow, state.a * self.fa, state.a),
                    torch.full_like(state.a, self.astart),
                ),
                state.a,
            )
            count = torch.where(
                started, torch.where(downhill, state.count + 1, 0), state.count
            )
            keep = rows.spread(started & downhill)
            velocities = torch.where(keep, mixed, 0.0)
            velocities = velocities + rows.spread(dt) * forces
            step = rows.spread(dt) * velocities
            length = rows.sum((step * step).sum(dim=-1)).sqrt()
            scale = torch.where(
                length > self.maxstep, self.maxstep / length.clamp_min(1e-300), 1.0
            )
            if self.downhill_check:
                self.previous_positions = batch.positions.detach().clone()
                self.previous_cell = batch.cell.detach().clone()
            rows.set_velocities(velocities, self._cell_velocities(), active)
            rows.move(step * rows.spread(scale))
            keep_inactive(state.dt, dt, active)
            keep_inactive(state.a, a, active)
            keep_inactive(state.count, count, active)
            keep_inactive(state.started, torch.ones_like(started), active)

    def _go_back_if_uphill(
        self,
        batch: Batch,
        rows: Rows,
        started: torch.Tensor,
        active: torch.Tensor | None,
    ) -> torch.Tensor:
        """Put uphill structures back at their previous positions; [B] bool."""
        state = self._state
        if not self.downhill_check:
            return torch.zeros_like(started)
        energy = rows.energy()
        previous = self.previous_positions
        uphill = started & (energy > state.last_energy)
        if previous is not None and previous.shape == batch.positions.shape:
            if self.reset_callback is not None and bool(uphill.any()):
                self.reset_callback(uphill, previous, energy, state.last_energy)
            back = uphill[batch.batch_idx.long()].unsqueeze(-1)
            batch.positions.copy_(torch.where(back, previous, batch.positions))
            if self.cell_filter is not None and self.previous_cell is not None:
                cell = torch.where(
                    uphill.view(-1, 1, 1), self.previous_cell, batch.cell
                )
                batch.cell.copy_(cell)
        # ASE re-reads the energy at the positions it went back to: the old one
        keep_inactive(
            state.last_energy, torch.where(uphill, state.last_energy, energy), active
        )
        return uphill

    def _cell_velocities(self) -> torch.Tensor | None:
        """[B, 3, 3] velocities of the cell rows (state), None without a filter."""
        return None if self.cell_filter is None else self._state.cell_velocities

    def post_update(self, batch: Batch) -> None:
        """No-op: the next step uses the forces at the new positions."""
