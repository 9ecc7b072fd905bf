"""``ABCFIRE2``: ASE's FIRE2 with ``use_abc=True`` (ABC-FIRE), batched.

nvalchemi 0.3's ``FIRE2`` kernel has no bias correction. This engine is
``ase.optimize.FIRE2.step`` with every sum taken per structure (Echenique et
al., ABC-FIRE). Per structure b, forces F (frozen atoms' zero), unit masses,
velocities v, and ``count`` (ASE's ``Nsteps``):

1. First step: v = 0. Later steps, with ``P = F·v``: if P > 0, ``count += 1``
   and, once ``count > Nmin``, ``dt ← min(dt · finc, dtmax)``, ``a ← a · fa``;
   otherwise ``count = 0``, ``dt ← max(dt · fdec, dtmin)``, ``a = astart``,
   ``x ← x - dt v / 2`` and v = 0.
2. ``v ← v + dt F``; ``a ← max(a, 1e-10)``;
   ``v ← ((1 - a) v + a |v| F/|F|) / (1 - (1 - a)^(count + 1))``; each
   component of v clipped to ``±maxstep/dt``; ``x ← x + dt v``.

After the half step back of a restart ASE evaluates the forces there before
step 2; so does this engine (the whole batch, once, when any structure
restarted: neighbour lists, model, constraints; the check reads one flag back
to the host per step). Each structure follows ASE's FIRE2 on it alone.

Under ASE's cell filters (``cell_filter``) the step acts on the filter's
N + 3 rows (:mod:`~nvalchemi_ase.engines.cell_filter`), the cell rows'
velocities in the state (``cell_velocities`` [B, 3, 3]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from nvalchemi.data import Batch

from nvalchemi_ase._compat import evaluate_again, post_update_is_noop
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
    from nvalchemi.dynamics.base import ConvergenceHook
    from nvalchemi.hooks import Hook
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ABCFIRE2"]

#: ASE's floor of the mixing parameter under ABC.
_SMALLEST_MIXING = 1e-10


@post_update_is_noop
class ABCFIRE2(PerGraphEngine):
    """Batched ABC-FIRE with ASE's arithmetic (``ase.optimize.FIRE2(use_abc=True)``).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    dt, dtmax, dtmin : float
        Initial, largest and smallest time step, internal (= ASE) time units.
    maxstep : float
        Largest step of any coordinate (each Cartesian component), Å.
    n_min : int
        Downhill steps before the time step grows (ASE's ``Nmin``).
    finc, fdec : float
        Time-step growth and shrink factors.
    astart, fa : float
        Initial mixing parameter and its decay factor.
    cell_filter : CellFilterCoordinates, optional
        Relax in the coordinates of ASE's cell filters (cell included).
    n_steps, hooks, convergence_hook, **kwargs
        See :class:`~nvalchemi_ase.engines._common.PerGraphEngine`
        (``by_group=True`` is refused).
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
        dtmin: float = 2e-3,
        n_min: int = 20,
        finc: float = 1.1,
        fdec: float = 0.5,
        astart: float = 0.25,
        fa: float = 0.99,
        cell_filter: CellFilterCoordinates | None = None,
        n_steps: int | None = None,
        hooks: list[Hook] | None = None,
        convergence_hook: ConvergenceHook | dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model,
            n_steps=n_steps,
            hooks=hooks,
            convergence_hook=convergence_hook,
            **kwargs,
        )
        self.dt = finite_positive("dt", dt)
        self.maxstep = finite_positive("maxstep (Å)", maxstep)
        self.dtmax = finite_positive("dtmax", dtmax)
        self.dtmin = finite_positive("dtmin", dtmin)
        self.n_min = int(n_min)
        self.finc, self.fdec = float(finc), float(fdec)
        self.astart, self.fa = float(astart), float(fa)
        self.cell_filter = cell_filter
        if cell_filter is not None:
            self.__needs_keys__ = {"forces", "stress"}
            self.__provides_keys__ = {"positions", "velocities", "cell"}

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(batch.num_graphs, batch)

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        return self._new_state(n, template_batch)

    def _new_state(self, count: int, template: Batch) -> Batch:
        return fire_state(
            count,
            template,
            dt=self.dt,
            a=self.astart,
            cell_rows=self.cell_filter is not None,
        )

    def pre_update(self, batch: Batch) -> None:
        """One ABC-FIRE step of every structure (see the module docstring).

        Parameters
        ----------
        batch : Batch
            ``velocities`` [V, 3] and ``positions`` [V, 3] Å updated in place
            from ``forces`` [V, 3] eV/Å.
        """
        state = self._state
        if state.num_graphs != batch.num_graphs:
            raise RuntimeError(
                f"ABCFIRE2 holds state for {state.num_graphs} graphs but the batch "
                f"has {batch.num_graphs}; build one engine per batch composition"
            )
        with torch.no_grad():
            rows = Rows(batch, self.cell_filter)
            active = active_graphs(self, batch)
            forces = rows.forces()
            cell_velocities = self._cell_velocities()
            velocities = rows.velocities(cell_velocities)
            started = state.started
            downhill = started & (rows.sum((forces * velocities).sum(dim=-1)) > 0)
            restart = started & ~downhill
            if active is not None:  # finished structures stay where they are
                restart = restart & active
            count = torch.where(downhill, state.count + 1, 0)
            grow = downhill & (count > self.n_min)
            dt = torch.where(
                grow, (state.dt * self.finc).clamp_max(self.dtmax), state.dt
            )
            dt = torch.where(restart, (state.dt * self.fdec).clamp_min(self.dtmin), dt)
            a = torch.where(grow, state.a * self.fa, state.a)
            a = torch.where(restart, torch.full_like(a, self.astart), a)
            count = torch.where(started, count, state.count)
            if bool(restart.any()):
                forces = self._restart(batch, rows, restart, dt, velocities)
            velocities = torch.where(rows.spread(downhill), velocities, 0.0)
            velocities = velocities + rows.spread(dt) * forces
            a = a.clamp_min(_SMALLEST_MIXING)
            speed = rows.sum((velocities * velocities).sum(dim=-1)).sqrt()
            force_norm = rows.sum((forces * forces).sum(dim=-1)).sqrt()
            mixed = (
                rows.spread(1.0 - a) * velocities
                + rows.spread(a * speed / force_norm.clamp_min(1e-300)) * forces
            )
            correction = 1.0 / (1.0 - (1.0 - a) ** (count + 1).to(a.dtype))
            limit = rows.spread(self.maxstep / dt)
            velocities = torch.clamp(
                rows.spread(correction) * mixed, min=-limit, max=limit
            )
            rows.set_velocities(velocities, cell_velocities, active)
            rows.move(rows.spread(dt) * velocities)
            keep_inactive(state.dt, dt, active)
            keep_inactive(state.a, a, active)
            keep_inactive(state.count, count, active)
            keep_inactive(state.started, torch.ones_like(started), active)

    def _restart(
        self,
        batch: Batch,
        rows: Rows,
        restart: torch.Tensor,
        dt: torch.Tensor,
        velocities: torch.Tensor,
    ) -> torch.Tensor:
        """Half a step back (``x - dt v / 2``) where ``restart``; new forces [R, 3].

        ASE reads the forces at the positions it went back to, so the model
        is evaluated again (every structure; the others have not moved).
        """
        rows.move(rows.spread(torch.where(restart, -0.5 * dt, 0.0)) * velocities)
        evaluate_again(self, batch)
        return rows.forces()

    def _cell_velocities(self) -> torch.Tensor | None:
        """[B, 3, 3] velocities of the cell rows (state), None without a filter."""
        return None if self.cell_filter is None else self._state.cell_velocities

    def post_update(self, batch: Batch) -> None:
        """No-op: the next step uses the forces at the new positions."""
