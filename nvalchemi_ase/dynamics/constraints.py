"""ASE constraints other than ``FixAtoms``, applied to a whole batch on the device.

``FixAtoms`` is nvalchemi's own frozen-atom category (``nvalchemi_ase.convert``). The
constraints here have no nvalchemi counterpart; one set of hooks applies
them to every structure of a batch at the points where ASE's dynamics call
the constraint's methods:

=================  ======================  ==========================================
ASE method         when ASE calls it       hook stage here
=================  ======================  ==========================================
``adjust_forces``  ``atoms.get_forces()``  ``AFTER_COMPUTE`` (forces; stress too)
``adjust_stress``  ``atoms.get_stress()``  ``AFTER_COMPUTE``
``adjust_positions`` ``set_positions``     after ``pre_update`` and ``post_update``
                                           (the step, relative to the positions
                                           before that update)
``adjust_cell``    ``set_cell`` (filters)  with the positions (FixSymmetry)
``adjust_momenta`` ``set_momenta``         after ``post_update`` (velocities)
=================  ======================  ==========================================

``FixBondLengths`` and ``FixLinearTriatomic`` (:mod:`.rigid`) follow ASE's
MD as well as its optimizers: in MD their forces are left as the model gave
them (``get_forces(md=True)``; ``FixLinearTriatomic``'s
``redistribute_forces_md`` is applied only while the engine's kicks read
them), the velocities after the drift are the constrained displacement over
the time step (``VelocityVerlet``: ``p = (x' - x) m / dt``) and the
velocities after the second kick are RATTLEd; in optimizers forces are
projected (``adjust_forces``) and every step is SHAKEn.

Semantics are ASE 3.29's (``ase/constraints/fix_com.py``,
``fix_cartesian.py``, ``fix_symmetry.py`` with
``ase/spacegroup/symmetrize.py``):

* ``FixCartesian(a, mask)``: masked components of the listed atoms keep their
  positions; their forces and momenta are zeroed.
* ``FixCom()``: each step is shifted so that the mass-weighted centre stays;
  forces lose ``m_i λ`` with ``λ = Σ m f / Σ m²``; velocities lose the
  centre-of-mass velocity.
* ``FixSymmetry(atoms, ...)``: forces, steps and momenta are symmetrised as
  rank-1 tensors, ``v'_{map_k(i)} = (1/K) Σ_k L^T r_k L^{-T} v_i`` (fractional
  rotations r_k and atom maps of the constraint, lattice L of the current
  cell); stress and cell deformations as rank-2 tensors,
  ``σ' = L^{-1} [(1/K) Σ_k r_k^T (L σ L^T) r_k] L^{-T}``. The rotations are
  fractional, so they hold in the batch's frame too when the variable-cell
  optimizers rotate a cell to their standard orientation.

All of it is gathers, one batched 3×3 product per (atom, symmetry
operation) and ``index_add``: no Python loop over structures or atoms per
step. Other ASE constraints are refused by name before any step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ase import Atoms
from ase.constraints import (
    FixAtoms,
    FixBondLengths,
    FixCartesian,
    FixCom,
    FixLinearTriatomic,
    FixSymmetry,
)

from nvalchemi_ase.convert import FROZEN_CATEGORY
from nvalchemi_ase.dynamics.failures import CONSTRAINTS_DID_NOT_CONVERGE, FailureGuard
from nvalchemi_ase.dynamics.hooks import StageHook
from nvalchemi_ase.dynamics.rigid import (
    Geometry,
    bond_constraints,
    linear_triatomics,
)

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["SUPPORTED_CONSTRAINTS", "BatchConstraints", "unsupported_constraint"]

#: ASE constraint classes the dynamics honour (FixAtoms through nvalchemi).
SUPPORTED_CONSTRAINTS: tuple[type, ...] = (
    FixAtoms,
    FixCartesian,
    FixCom,
    FixSymmetry,
    FixBondLengths,
    FixLinearTriatomic,
)

#: Constraints whose degrees of freedom ASE's ``get_removed_dof`` counts here
#: (``FixAtoms``' are the frozen atoms' own).
_COUNTED_DOF: tuple[type, ...] = (
    FixCartesian,
    FixCom,
    FixBondLengths,
    FixLinearTriatomic,
)


def unsupported_constraint(atoms: Atoms) -> str | None:
    """Name the first constraint of ``atoms`` the dynamics cannot honour.

    Parameters
    ----------
    atoms : ase.Atoms
        One structure.

    Returns
    -------
    str or None
        The constraint's class name (exact classes only: a subclass such as
        ``FixSubsetCom`` changes the semantics), or None.
    """
    for constraint in atoms.constraints:
        if type(constraint) not in SUPPORTED_CONSTRAINTS:
            return type(constraint).__name__
    return None


@dataclass
class _Symmetry:
    """Every (atom, operation) pair of the structures under ``FixSymmetry``.

    ``source``/``target`` [P] global atom indices (``v'[target] += C v[source]``),
    ``operation`` [P] index into ``rotations`` [R, 3, 3] (fractional, float),
    ``operation_graph`` [R] structure of each operation, ``count`` [B]
    operations per structure (1 where there is none, to divide safely),
    ``atoms`` [V] bool atoms under symmetry, ``graphs`` [B] bool,
    ``positions``/``cell`` [B] bool: whether steps and cell are adjusted.
    """

    source: torch.Tensor
    target: torch.Tensor
    operation: torch.Tensor
    rotations: torch.Tensor
    operation_graph: torch.Tensor
    count: torch.Tensor
    atoms: torch.Tensor
    graphs: torch.Tensor
    positions: torch.Tensor
    cell: torch.Tensor


class BatchConstraints:
    """The ASE constraints of a batch as device tensors, and their hooks.

    Parameters
    ----------
    images : sequence of ase.Atoms
        The structures, in batch order (their constraints are read here).
    batch : nvalchemi.data.Batch
        Their batch (device, dtype, ``batch_idx``).
    timestep : callable, optional
        Returns the MD time step, ASE time units (``FixBondLengths`` and
        ``FixLinearTriatomic`` take the velocities after the drift from the
        constrained displacement over it).
    guard : FailureGuard, optional
        Where a structure whose bond constraints do not converge is flagged
        (skipped from then on); without one such a structure raises.

    Raises
    ------
    ValueError
        For a constraint that is not supported, naming the structure.
    """

    def __init__(
        self,
        images: Sequence[Atoms],
        batch: Batch,
        *,
        timestep: Callable[[], Any] | None = None,
        guard: FailureGuard | None = None,
    ) -> None:
        self._batch_idx = batch.batch_idx.long()
        self._num_graphs = len(images)
        self._device = batch.positions.device
        self._dtype = batch.positions.dtype
        self._categories = batch.atom_categories
        self._pbc = batch.pbc
        self._timestep = timestep
        self._guard = guard
        self._md = False
        self._saved: dict[str, torch.Tensor] = {}
        self.refresh(images)

    def refresh(self, images: Sequence[Atoms]) -> None:
        """Read the structures' constraints again (they changed between runs).

        Parameters
        ----------
        images : sequence of ase.Atoms
            The same structures, in batch order.
        """
        for index, atoms in enumerate(images):
            name = unsupported_constraint(atoms)
            if name is not None:
                raise ValueError(f"images[{index}] has unsupported constraint {name}")
        device, dtype = self._device, self._dtype
        sizes = [len(atoms) for atoms in images]
        # ASE's constraints weigh with ``atoms.get_masses()``, also in optimizers,
        # whose batch carries unit masses for the fictitious dynamics
        masses = np.concatenate([atoms.get_masses() for atoms in images])
        self._masses = torch.as_tensor(masses, dtype=dtype, device=device).unsqueeze(-1)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.cartesian = _cartesian_mask(images, offsets, sum(sizes), device)
        com = [any(type(c) is FixCom for c in a.constraints) for a in images]
        self.com = torch.tensor(com, device=device) if any(com) else None
        self.symmetry = _symmetry(images, offsets, sum(sizes), device, dtype)
        free = (self._categories != FROZEN_CATEGORY).to(dtype)
        self.bonds = bond_constraints(images, offsets, self._masses.squeeze(-1), free)
        self.triatomics = linear_triatomics(images, offsets, device, dtype)
        rigid = np.repeat(
            [
                any(
                    type(c) in (FixBondLengths, FixLinearTriatomic)
                    for c in a.constraints
                )
                for a in images
            ],
            sizes,
        )
        #: [V, 1] bool: atoms of structures with RATTLE-type constraints.
        self._rigid_atoms = torch.as_tensor(rigid, device=device).unsqueeze(-1)
        self._periodic = bool(np.any([a.pbc.any() for a in images]))
        #: Degrees of freedom the constraints remove, (B,): ASE's
        #: ``get_removed_dof`` (FixAtoms' are the frozen atoms' own).
        self.removed_dof = np.array(
            [
                sum(
                    c.get_removed_dof(atoms)
                    for c in atoms.constraints
                    if type(c) in _COUNTED_DOF
                )
                for atoms in images
            ],
            dtype=np.float64,
        )

    @property
    def any(self) -> bool:
        """Whether any structure has a constraint handled here."""
        return (
            self.cartesian is not None
            or self.com is not None
            or self.symmetry is not None
            or self.rigid
        )

    @property
    def rigid(self) -> bool:
        """Whether any structure has ``FixBondLengths`` or ``FixLinearTriatomic``."""
        return self.bonds is not None or self.triatomics is not None

    def hooks(self, stages: Any, *, momenta: bool) -> list[Any]:
        """Return the hooks applying the constraints (``DynamicsStage`` ``stages``).

        Parameters
        ----------
        stages : nvalchemi.dynamics.base.DynamicsStage
            The stage enumeration.
        momenta : bool
            Whether the batch's velocities are the atoms' (MD: ASE's
            ``adjust_momenta`` applies) or an optimizer's own (FIRE's, left
            alone as ASE's optimizers leave theirs).

        Returns
        -------
        list
            Hooks to register after the failure guard's.
        """
        self._md = momenta
        if not momenta:
            return [
                StageHook(stages.AFTER_COMPUTE, self.adjust_forces_and_stress),
                StageHook(stages.BEFORE_PRE_UPDATE, self.save),
                StageHook(stages.AFTER_PRE_UPDATE, self.adjust_step),
                StageHook(stages.BEFORE_POST_UPDATE, self.save),
                StageHook(stages.AFTER_POST_UPDATE, self.adjust_step),
            ]
        return [
            StageHook(stages.AFTER_COMPUTE, self.adjust_forces_and_stress),
            StageHook(stages.BEFORE_PRE_UPDATE, self.save_for_kick),
            StageHook(stages.AFTER_PRE_UPDATE, self.adjust_drift),
            StageHook(stages.BEFORE_POST_UPDATE, self.save_for_kick),
            StageHook(stages.AFTER_POST_UPDATE, self.adjust_step_and_momenta),
        ]

    # -- what the hooks do -----------------------------------------------------------

    def save(self, batch: Batch) -> None:
        """Remember positions and cell before an update (the step's origin)."""
        for key in ("positions", "cell"):
            value = getattr(batch, key).detach()
            saved = self._saved.get(key)
            if saved is None or saved.shape != value.shape:
                self._saved[key] = value.clone()
            else:
                saved.copy_(value)

    def save_for_kick(self, batch: Batch) -> None:
        """:meth:`save`; in MD with ``FixLinearTriatomic``, its force redistribution.

        ASE's MD kicks with ``get_forces(md=True)``, where each triple's forces
        are redistributed (``redistribute_forces_md``); the engine's kick sees
        them, and the model's forces are put back after the update.
        """
        self.save(batch)
        if self.triatomics is None:
            return
        with torch.no_grad():
            forces = batch.forces.detach()
            saved = self._saved.get("forces")
            if saved is None or saved.shape != forces.shape:
                self._saved["forces"] = forces.clone()
            else:
                saved.copy_(forces)
            self.triatomics.redistribute_md(forces)

    def adjust_forces_and_stress(self, batch: Batch) -> None:
        """ASE's ``adjust_forces`` and ``adjust_stress`` on the new model output.

        In MD, ``FixBondLengths`` and ``FixLinearTriatomic`` leave forces alone
        (ASE's ``get_forces(md=True)``).
        """
        with torch.no_grad():
            forces = self._forces(batch.forces.detach(), batch.cell)
            if not self._md:
                self._rigid_forces(forces, batch)
            batch.forces.copy_(forces)
            stress = getattr(batch, "stress", None)
            if self.symmetry is not None and isinstance(stress, torch.Tensor):
                stress.copy_(self._rank2(stress.detach(), batch.cell))

    def adjust_step(self, batch: Batch) -> None:
        """ASE's ``adjust_cell`` and ``adjust_positions`` on the update's step."""
        with torch.no_grad():
            old_positions = self._saved["positions"]
            step = self._step(batch.positions.detach() - old_positions)
            positions = old_positions + step
            if self.symmetry is not None:
                positions = self._symmetric_step(batch, old_positions, positions)
            if self.rigid:
                self._rigid_positions(old_positions, positions, batch)
            batch.positions.copy_(positions)

    def adjust_drift(self, batch: Batch) -> None:
        """MD after the drift: :meth:`adjust_step`, then ASE's velocities.

        With RATTLE-type constraints ASE's integrators take the velocities
        from the constrained displacement, ``p = (x' - x) m / dt``: here the
        velocities gain the constraint's correction over the time step,
        ``(x' - x_free) / dt``, which is that for velocity Verlet and keeps
        the noise a thermostat added between two drifts (BAOAB); the
        model's forces come back where a kick redistributed them.
        """
        if not self.rigid:
            self.adjust_step(batch)
            return
        unconstrained = batch.positions.detach().clone()
        self.adjust_step(batch)
        with torch.no_grad():
            self._restore_forces(batch)
            velocities = getattr(batch, "velocities", None)
            timestep = None if self._timestep is None else self._timestep()
            if not isinstance(velocities, torch.Tensor) or timestep is None:
                return
            if not np.ndim(timestep):
                timestep = float(timestep)
            else:  # one per structure
                timestep = torch.as_tensor(
                    np.asarray(timestep, dtype=np.float64),
                    dtype=velocities.dtype,
                    device=velocities.device,
                )[self._batch_idx].unsqueeze(-1)
            correction = (batch.positions.detach() - unconstrained) / timestep
            velocities.add_(torch.where(self._rigid_atoms, correction, 0.0))

    def adjust_step_and_momenta(self, batch: Batch) -> None:
        """:meth:`adjust_step`, then ASE's ``adjust_momenta`` on the velocities."""
        self.adjust_step(batch)
        velocities = getattr(batch, "velocities", None)
        with torch.no_grad():
            if isinstance(velocities, torch.Tensor):
                adjusted = self._momenta(velocities.detach(), batch.cell)
                if self.rigid:
                    self._rigid_velocities(adjusted, batch)
                velocities.copy_(adjusted)
            self._restore_forces(batch)

    # -- RATTLE-type constraints (rigid.py) -------------------------------------------

    def _geometry(self, batch: Batch) -> Geometry | None:
        if not self._periodic:
            return None
        return Geometry(cell=batch.cell.detach(), pbc=self._pbc.to(torch.bool))

    def _failed(self) -> torch.Tensor | None:
        return None if self._guard is None else self._guard.failed

    def _report(self, failed: torch.Tensor) -> None:
        """Flag structures whose bonds did not converge (or raise without a guard)."""
        if self._guard is not None:
            self._guard.flag(failed, CONSTRAINTS_DID_NOT_CONVERGE)
            return
        if bool(failed.any()):
            indices = torch.nonzero(failed).flatten().tolist()
            raise RuntimeError(
                f"images{indices}: FixBondLengths did not converge within maxiter "
                "iterations"
            )

    def _rigid_positions(
        self, old: torch.Tensor, new: torch.Tensor, batch: Batch
    ) -> None:
        geometry = self._geometry(batch)
        if self.bonds is not None:
            self._report(self.bonds.shake(old, new, geometry, skip=self._failed()))
        if self.triatomics is not None:
            self.triatomics.adjust_positions(old, new, geometry)

    def _rigid_velocities(self, velocities: torch.Tensor, batch: Batch) -> None:
        geometry = self._geometry(batch)
        positions = batch.positions.detach()
        if self.bonds is not None:
            failed = self.bonds.rattle(
                velocities,
                positions,
                geometry,
                as_momenta=False,
                masses=self._masses.squeeze(-1),
                skip=self._failed(),
            )
            self._report(failed)
        if self.triatomics is not None:
            self.triatomics.adjust_velocities(velocities, positions, geometry)

    def _rigid_forces(self, forces: torch.Tensor, batch: Batch) -> None:
        """ASE's ``adjust_forces`` of both (optimizers)."""
        geometry = self._geometry(batch)
        positions = batch.positions.detach()
        if self.bonds is not None:
            failed = self.bonds.rattle(
                forces,
                positions,
                geometry,
                as_momenta=True,
                masses=self._masses.squeeze(-1),
                skip=self._failed(),
            )
            self._report(failed)
        if self.triatomics is not None:
            self.triatomics.adjust_forces(forces, positions, geometry)

    def _restore_forces(self, batch: Batch) -> None:
        """Put the model's forces back after a kick that read redistributed ones."""
        saved = self._saved.get("forces")
        if self.triatomics is not None and saved is not None:
            batch.forces.copy_(saved)

    # -- the constraints -------------------------------------------------------------

    def _forces(self, forces: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        if self.cartesian is not None:
            forces = torch.where(self.cartesian, 0.0, forces)
        if self.com is not None:
            masses = self._masses
            weight = self._per_graph(masses * forces) / self._per_graph(masses**2)
            removed = masses * weight[self._batch_idx]
            forces = forces - torch.where(self._com_atoms(), removed, 0.0)
        if self.symmetry is not None:
            forces = self._rank1(forces, cell)
        return forces

    def _momenta(self, velocities: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        if self.cartesian is not None:
            velocities = torch.where(self.cartesian, 0.0, velocities)
        if self.com is not None:
            masses = self._masses
            centre = self._per_graph(masses * velocities) / self._per_graph(masses)
            velocities = velocities - torch.where(
                self._com_atoms(), centre[self._batch_idx], 0.0
            )
        if self.symmetry is not None:
            velocities = self._rank1(velocities, cell)
        return velocities

    def _step(self, step: torch.Tensor) -> torch.Tensor:
        """``FixCartesian`` and ``FixCom`` on a step [V, 3], Å."""
        if self.cartesian is not None:
            step = torch.where(self.cartesian, 0.0, step)
        if self.com is not None:
            masses = self._masses
            moved = self._per_graph(masses * step) / self._per_graph(masses)
            step = step - torch.where(self._com_atoms(), moved[self._batch_idx], 0.0)
        return step

    def _symmetric_step(
        self, batch: Batch, old_positions: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``FixSymmetry`` on an update, in fractional coordinates and the metric.

        A cell update of nvalchemi's variable-cell engines is a strain and a
        rotation (they keep cells lower-triangular); neither the fractional
        coordinates nor the metric ``G = L L^T`` see the rotation. The step of
        the fractional coordinates is symmetrised as a rank-1 tensor,
        ``Δs'_{map_k(i)} = (1/K) Σ_k r_k Δs_i``, and the metric as
        ``G' = (1/K) Σ_k r_k^T G r_k`` (ASE's ``adjust_positions`` and
        ``adjust_cell``, which symmetrise the same quantities in a lattice
        frame); the cell with metric ``G'`` keeps the orientation of the
        engine's new cell. Unchanged cells are kept bit for bit. Returns the
        positions [V, 3], Å; ``batch.cell`` is updated in place.
        """
        symmetry = self.symmetry
        assert symmetry is not None  # noqa: S101 - the caller checks
        old_cell = self._saved["cell"]
        new_cell = batch.cell.detach()
        moved = (new_cell != old_cell).flatten(1).any(dim=1) & symmetry.cell
        cell = torch.where(
            moved.view(-1, 1, 1), self._symmetric_cell(new_cell), new_cell
        )
        index = self._batch_idx
        old_fractional = _fractional(old_positions, old_cell, index)
        fractional = _fractional(positions, new_cell, index)
        step = fractional - old_fractional
        symmetric = self._fractional_rank1(step)
        keep = symmetry.positions[index].unsqueeze(-1)
        fractional = old_fractional + torch.where(keep, symmetric, step)
        result = torch.einsum("va,vab->vb", fractional, cell[index])
        under = symmetry.atoms.unsqueeze(-1)
        batch.cell.copy_(cell)
        return torch.where(under, result, positions)

    def _fractional_rank1(self, vectors: torch.Tensor) -> torch.Tensor:
        """Symmetrise fractional vectors [V, 3]: (1/K) Σ_k r_k v_i onto map_k(i)."""
        symmetry = self.symmetry
        assert symmetry is not None  # noqa: S101 - callers check
        moved = torch.einsum(
            "pab,pb->pa",
            symmetry.rotations[symmetry.operation],
            vectors[symmetry.source],
        )
        total = torch.zeros_like(vectors).index_add_(0, symmetry.target, moved)
        return total / symmetry.count[self._batch_idx].unsqueeze(-1)

    def _symmetric_cell(self, cell: torch.Tensor) -> torch.Tensor:
        """Return the cell [B, 3, 3] with a symmetrised metric, as ``cell`` points."""
        symmetry = self.symmetry
        assert symmetry is not None  # noqa: S101 - callers check
        metric = cell @ cell.mT
        rotations = symmetry.rotations
        per_operation = rotations.mT @ metric[symmetry.operation_graph] @ rotations
        total = torch.zeros_like(metric).index_add_(
            0, symmetry.operation_graph, per_operation
        )
        symmetric = total / symmetry.count.view(-1, 1, 1)
        # cell = C O with C lower-triangular (C C^T = G) and O orthogonal
        current = torch.linalg.cholesky(metric)
        orientation = torch.linalg.solve(current, cell)
        return torch.linalg.cholesky(symmetric) @ orientation

    def _rank1(self, vectors: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """Symmetrise per-atom vectors [V, 3] of the structures under symmetry."""
        symmetry = self.symmetry
        assert symmetry is not None  # noqa: S101 - callers check
        lattice = cell.detach()[symmetry.operation_graph]  # [R, 3, 3] rows a, b, c
        inverse = torch.linalg.inv(lattice)
        cartesian = lattice.mT @ symmetry.rotations @ inverse.mT  # L^T r L^-T
        moved = torch.einsum(
            "pab,pb->pa", cartesian[symmetry.operation], vectors[symmetry.source]
        )
        total = torch.zeros_like(vectors).index_add_(0, symmetry.target, moved)
        averaged = total / symmetry.count[self._batch_idx].unsqueeze(-1)
        return torch.where(symmetry.atoms.unsqueeze(-1), averaged, vectors)

    def _rank2(self, tensor: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """Symmetrise per-structure 3×3 tensors [B, 3, 3] (stress, strain)."""
        symmetry = self.symmetry
        assert symmetry is not None  # noqa: S101 - callers check
        lattice = cell.detach()
        scaled = lattice @ tensor @ lattice.mT  # L σ L^T
        rotations = symmetry.rotations
        per_operation = rotations.mT @ scaled[symmetry.operation_graph] @ rotations
        total = torch.zeros_like(tensor).index_add_(
            0, symmetry.operation_graph, per_operation
        )
        averaged = total / symmetry.count.view(-1, 1, 1)
        inverse = torch.linalg.inv(lattice)
        result = inverse @ averaged @ inverse.mT
        return torch.where(symmetry.graphs.view(-1, 1, 1), result, tensor)

    def _per_graph(self, values: torch.Tensor) -> torch.Tensor:
        total = values.new_zeros((self._num_graphs, *values.shape[1:]))
        return total.index_add_(0, self._batch_idx, values)

    def _com_atoms(self) -> torch.Tensor:
        assert self.com is not None  # noqa: S101 - callers check
        return self.com[self._batch_idx].unsqueeze(-1)


def _fractional(
    positions: torch.Tensor, cell: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Fractional coordinates [V, 3] of Cartesian positions (rows: x = s L)."""
    inverse = torch.linalg.inv(cell)[index]
    return torch.einsum("va,vab->vb", positions, inverse)


def _cartesian_mask(
    images: Sequence[Atoms], offsets: np.ndarray, count: int, device: torch.device
) -> torch.Tensor | None:
    """[V, 3] bool, True where ``FixCartesian`` holds a component; None if none."""
    mask = np.zeros((count, 3), dtype=bool)
    for atoms, offset in zip(images, offsets, strict=True):
        for constraint in atoms.constraints:
            if type(constraint) is FixCartesian:
                indices = np.asarray(constraint.index, dtype=np.int64) + offset
                mask[indices] |= np.asarray(constraint.mask, dtype=bool)
    return torch.as_tensor(mask, device=device) if mask.any() else None


def _symmetry(
    images: Sequence[Atoms],
    offsets: np.ndarray,
    count: int,
    device: torch.device,
    dtype: torch.dtype,
) -> _Symmetry | None:
    """Collect the (atom, operation) pairs of every ``FixSymmetry`` (None: none)."""
    sources, targets, operations, rotations, operation_graphs = [], [], [], [], []
    counts = np.ones(len(images))
    graphs = np.zeros(len(images), dtype=bool)
    positions = np.zeros(len(images), dtype=bool)
    cells = np.zeros(len(images), dtype=bool)
    atoms_mask = np.zeros(count, dtype=bool)
    first_operation = 0
    for graph, (atoms, offset) in enumerate(zip(images, offsets, strict=True)):
        constraint = next(
            (c for c in atoms.constraints if type(c) is FixSymmetry), None
        )
        if constraint is None:
            continue
        maps = np.asarray(constraint.symm_map, dtype=np.int64)  # [K, N]
        if maps.shape[1] != len(atoms):
            raise ValueError(
                f"images[{graph}]: its FixSymmetry was built for {maps.shape[1]} "
                f"atoms, the structure has {len(atoms)}; build it on this structure"
            )
        operations_here = maps.shape[0]
        natoms = len(atoms)
        sources.append(np.tile(np.arange(natoms), operations_here) + offset)
        targets.append(maps.reshape(-1) + offset)
        operations.append(
            np.repeat(np.arange(operations_here), natoms) + first_operation
        )
        rotations.append(np.asarray(constraint.rotations, dtype=np.float64))
        operation_graphs.append(np.full(operations_here, graph))
        first_operation += operations_here
        counts[graph] = operations_here
        graphs[graph] = True
        positions[graph] = bool(constraint.do_adjust_positions)
        cells[graph] = bool(constraint.do_adjust_cell)
        atoms_mask[offset : offset + natoms] = True
    if not graphs.any():
        return None

    def tensor(value: np.ndarray, kind: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=kind, device=device)

    return _Symmetry(
        source=tensor(np.concatenate(sources), torch.long),
        target=tensor(np.concatenate(targets), torch.long),
        operation=tensor(np.concatenate(operations), torch.long),
        rotations=tensor(np.concatenate(rotations), dtype),
        operation_graph=tensor(np.concatenate(operation_graphs), torch.long),
        count=tensor(counts, dtype),
        atoms=tensor(atoms_mask, torch.bool),
        graphs=tensor(graphs, torch.bool),
        positions=tensor(positions, torch.bool),
        cell=tensor(cells, torch.bool),
    )
