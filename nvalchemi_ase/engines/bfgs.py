"""``BFGS``: quasi-Newton relaxation with a full Hessian per structure.

Each step of structure b, with gradient g = −F (frozen atoms' entries zero)
and positions x flattened to 3N_b numbers:

1. Unless it is the first step or x has not moved (max |Δx| < 1e-7 Å), update
   the Hessian with the BFGS formula, Δx = x − x_prev, Δg = g − g_prev::

       H ← H + Δg Δgᵀ / (Δx·Δg) − (H Δx)(H Δx)ᵀ / (Δx·H Δx)

2. Step along −H⁻¹g computed in H's eigenbasis with |eigenvalues| (so that a
   Hessian that lost positive definiteness still gives a descent-like step):
   Δ = −V diag(1/|ω|) Vᵀ g.
3. If the longest atomic displacement reaches ``maxstep``, scale the whole
   step down so that it equals ``maxstep`` (the direction is kept).

H starts as ``alpha`` × identity. This is the algorithm of ASE's ``BFGS``.
Under ASE's ``UnitCellFilter``/``FrechetCellFilter`` (``cell_filter``) x and g
are the filter's 3(N_b + 3) generalized coordinates and forces
(:mod:`~nvalchemi_ase.engines.cell_filter`), as ASE's BFGS has them.
Structures are padded to W = 3 × (largest atom count): the Hessians form one
[B, W, W] tensor (padding rows/columns decoupled, ``alpha`` on the diagonal)
and the eigendecompositions run as one batched call. Memory and time grow as
W² and W³ per structure; this suits structures up to a few hundred atoms, like
ASE's BFGS.
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

__all__ = ["ASEBFGS", "PaddedLayout"]

#: Displacement (Å) below which a step counts as "same configuration" and the
#: Hessian is not updated (ASE's threshold).
SAME_CONFIGURATION = 1e-7


class PaddedLayout:
    """Maps per-row [R, 3] tensors to padded per-structure [B, W] rows.

    Parameters
    ----------
    batch : Batch
        Supplies ``batch_idx`` and ``batch_ptr``.
    width : int
        W, at least 3 × (largest row count: atoms, + 3 under a cell filter).
    cell_filter : CellFilterCoordinates, optional
        Lay out the filter's N + 3 rows per structure (atoms, then the cell).
    """

    def __init__(
        self,
        batch: Batch,
        width: int,
        cell_filter: CellFilterCoordinates | None = None,
    ) -> None:
        rows = Rows(batch, cell_filter)
        components = torch.arange(3, device=rows.graph.device)
        self.rows = rows.graph.unsqueeze(-1).expand(-1, 3)
        self.columns = 3 * rows.local().unsqueeze(-1) + components
        self.shape = (batch.num_graphs, width)

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """Return per-row [R, 3] values as padded [B, W] rows (zero padding)."""
        padded = values.new_zeros(self.shape)
        return padded.index_put_((self.rows, self.columns), values)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Return the per-row [R, 3] values of padded [B, W] rows."""
        return padded[self.rows, self.columns]


@post_update_is_noop
class ASEBFGS(PerGraphEngine):
    """Batched BFGS with one dense Hessian per structure (ASE's algorithm).

    Parameters
    ----------
    model : BaseModelMixin
        The potential.
    maxstep : float
        Largest atomic displacement per step, Å (ASE's default 0.2).
    alpha : float
        Initial Hessian, eV/Å² times identity (ASE's default 70).
    cell_filter : CellFilterCoordinates, optional
        Relax in the coordinates of ASE's cell filters (cell included).
    **kwargs
        ``n_steps``, ``hooks``, ``convergence_hook``, ...: see
        :class:`~nvalchemi_ase.engines._common.PerGraphEngine`.

    Notes
    -----
    State per structure (``self._state``): ``hessian`` [B, W, W] eV/Å²,
    ``previous_positions`` and ``previous_gradient`` [B, W] (Å, eV/Å) and
    ``started`` [B] bool. Graphs with ``status >= exit_status`` keep all of it
    unchanged. The whole step happens in ``pre_update``; ``post_update`` is a
    no-op. Frozen atoms (``atom_categories == -1``) have zero gradient and are
    never displaced. Positions must not be edited between steps (e.g. by
    ``WrapPeriodicHook``): the Hessian is built from their differences.
    """

    __needs_keys__: set[str] = {"forces"}  # noqa: RUF012 - BaseDynamics types it set[str]
    __provides_keys__: set[str] = {"positions"}  # noqa: RUF012
    samples_equilibrium: ClassVar[bool] = False

    def __init__(
        self,
        model: BaseModelMixin,
        maxstep: float = 0.2,
        alpha: float = 70.0,
        cell_filter: CellFilterCoordinates | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.maxstep = finite_positive("maxstep (Å)", maxstep)
        self.alpha = finite_positive("alpha (eV/Å²)", alpha)
        self.cell_filter = cell_filter
        if cell_filter is not None:
            self.__needs_keys__ = {"forces", "stress"}
            self.__provides_keys__ = {"positions", "cell"}

    # -- state --------------------------------------------------------------------

    def _init_state(self, batch: Batch) -> None:
        self._state = self._new_state(
            batch.num_graphs,
            self._width_for(batch),
            batch.device,
            batch.positions.dtype,
        )

    def _make_new_state(self, n: int, template_batch: Batch) -> Batch:
        width = max(self._state_width(), self._width_for(template_batch))
        return self._new_state(
            n, width, template_batch.device, template_batch.positions.dtype
        )

    def _sync_state_to_batch(
        self, remaining_indices: torch.Tensor, n_new: int, template_batch: Batch
    ) -> None:
        """Widen the padded state first if admitted structures are larger."""
        if getattr(self, "_state", None) is not None:
            self._widen(self._width_for(template_batch))
        super()._sync_state_to_batch(remaining_indices, n_new, template_batch)

    def _new_state(
        self, count: int, width: int, device: torch.device, dtype: torch.dtype
    ) -> Batch:
        identity = torch.eye(width, dtype=dtype, device=device)
        return make_state(
            {
                "hessian": (self.alpha * identity).expand(count, -1, -1).clone(),
                "previous_positions": torch.zeros(
                    count, width, dtype=dtype, device=device
                ),
                "previous_gradient": torch.zeros(
                    count, width, dtype=dtype, device=device
                ),
                "started": torch.zeros(count, dtype=torch.bool, device=device),
            },
            device,
        )

    def _width_for(self, batch: Batch) -> int:
        """W = 3 × the largest structure's row count (one host read)."""
        extra = 0 if self.cell_filter is None else 3
        return 3 * (int(batch.num_nodes_per_graph.max()) + extra)

    def _state_width(self) -> int:
        state = getattr(self, "_state", None)
        return 0 if state is None else int(state.previous_positions.shape[1])

    def fit_checkpoint_state(self, saved: dict[str, Any]) -> None:
        """Widen the fresh state to a checkpoint's padded width before loading it.

        The padding only grows (a refilled working batch keeps the width of
        its largest structure so far), so a checkpoint may be wider than the
        state built for its structures; the padded block is decoupled (alpha
        × identity, zero displacement) and its width is restored as saved.

        Parameters
        ----------
        saved : dict of numpy.ndarray
            The checkpoint's ``engine/<field>`` arrays (``previous_positions``
            [B, W] gives W).
        """
        previous = saved.get("previous_positions")
        if previous is not None and getattr(self, "_state", None) is not None:
            self._widen(int(previous.shape[1]))

    def _widen(self, width: int) -> None:
        """Pad the stored state to ``width`` (new Hessian block: alpha × identity)."""
        old = self._state_width()
        if width <= old:
            return
        state = self._state
        previous = state.previous_positions
        grown = self._new_state(
            state.num_graphs, width, previous.device, previous.dtype
        )
        with torch.no_grad():
            grown.hessian[:, :old, :old] = state.hessian
            grown.previous_positions[:, :old] = state.previous_positions
            grown.previous_gradient[:, :old] = state.previous_gradient
            grown.started.copy_(state.started)
        self._state = grown

    # -- the step -----------------------------------------------------------------

    def pre_update(self, batch: Batch) -> None:
        """Update each Hessian, then move every structure by its BFGS step.

        Parameters
        ----------
        batch : Batch
            ``positions`` [V, 3] Å updated in place from ``forces`` [V, 3] eV/Å.
        """
        state = self._state
        if state.num_graphs != batch.num_graphs:
            raise RuntimeError(
                f"ASEBFGS holds state for {state.num_graphs} graphs but the batch has "
                f"{batch.num_graphs}; build one engine per batch composition"
            )
        with torch.no_grad():
            layout = PaddedLayout(batch, self._state_width(), self.cell_filter)
            rows = Rows(batch, self.cell_filter)
            free = rows.free().unsqueeze(-1)
            gradient = layout.pad(-rows.forces())
            positions = layout.pad(rows.positions())
            hessian = self._updated_hessian(positions, gradient)
            step = layout.unpad(self._limited_step(hessian, gradient))
            rows.move(torch.where(free, step, 0.0))
            active = active_graphs(self, batch)
            keep_inactive(state.hessian, hessian, active)
            keep_inactive(state.previous_positions, positions, active)
            keep_inactive(state.previous_gradient, gradient, active)
            keep_inactive(state.started, torch.ones_like(state.started), active)

    def post_update(self, batch: Batch) -> None:
        """No-op: the next step uses the forces at the new positions."""

    def replay_frame(
        self, positions: torch.Tensor, gradient: torch.Tensor, take: torch.Tensor
    ) -> None:
        """Take one earlier frame into the Hessians, as ASE's ``replay_trajectory``.

        The first frame a structure is given only becomes its previous point;
        each later one updates its Hessian (step 1 of the module docstring).
        The state must exist (after the engine's first evaluation).

        Parameters
        ----------
        positions, gradient : torch.Tensor, shape [B, W]
            The frame's positions (Å) and gradient −F (eV/Å, zero for frozen
            atoms), padded as :class:`PaddedLayout` does.
        take : torch.Tensor, shape [B] bool
            Structures this frame belongs to; the others are left alone.
        """
        state = self._state
        with torch.no_grad():
            hessian = self._updated_hessian(positions, gradient)
            keep_inactive(state.hessian, hessian, take)
            keep_inactive(state.previous_positions, positions, take)
            keep_inactive(state.previous_gradient, gradient, take)
            keep_inactive(state.started, torch.ones_like(state.started), take)

    def _updated_hessian(
        self, positions: torch.Tensor, gradient: torch.Tensor
    ) -> torch.Tensor:
        """BFGS update of every started structure that moved, [B, W, W]."""
        state = self._state
        hessian = state.hessian
        displacement = positions - state.previous_positions
        change = gradient - state.previous_gradient
        projected = torch.einsum("bij,bj->bi", hessian, displacement)
        curvature = (displacement * change).sum(dim=1, keepdim=True).unsqueeze(-1)
        stiffness = (displacement * projected).sum(dim=1, keepdim=True).unsqueeze(-1)
        update = (
            change.unsqueeze(-1) * change.unsqueeze(-2) / curvature
            - projected.unsqueeze(-1) * projected.unsqueeze(-2) / stiffness
        )
        moved = displacement.abs().amax(dim=1) >= SAME_CONFIGURATION
        apply = (state.started & moved).view(-1, 1, 1)
        return torch.where(apply, hessian + update, hessian)

    def _limited_step(
        self, hessian: torch.Tensor, gradient: torch.Tensor
    ) -> torch.Tensor:
        """Quasi-Newton step with |eigenvalues|, scaled to ``maxstep``, [B, W]."""
        eigenvalues, vectors = torch.linalg.eigh(hessian)
        coefficients = torch.einsum("bw,bwk->bk", gradient, vectors)
        step = -torch.einsum("bwk,bk->bw", vectors, coefficients / eigenvalues.abs())
        lengths = step.view(step.shape[0], -1, 3).norm(dim=-1).amax(dim=-1)
        scale = torch.where(
            lengths >= self.maxstep, self.maxstep / lengths, torch.ones_like(lengths)
        )
        return step * scale.unsqueeze(-1)
