"""ASE's RATTLE family: ``FixBondLengths`` and ``FixLinearTriatomic``, batched.

Every structure keeps its own bonds; all bonds of all structures are
iterated together, as tensors, until each structure's bonds are within its
constraint's tolerance. The formulas are ASE 3.29's
(``ase/constraints/fix_bond_lengths.py``, ``fix_linear_triatomic.py``):

* positions (SHAKE, ``adjust_positions``): for a bond ``a–b`` of length
  ``c`` with old vector ``d0`` (minimum image) and new vector ``d1``,
  ``x = ½ (c² − d1·d1) / (d0·d1)``; ``a`` moves by ``x μ/m_a d0`` and ``b``
  by ``−x μ/m_b d0`` (``μ`` the reduced mass) while ``|x| > tolerance``;
* momenta and, in optimizers, forces (RATTLE, ``adjust_momenta`` /
  ``adjust_forces``): ``x = −(v_a − v_b)·d / c²`` with the current bond
  vector ``d``, the same mass weights;
* ``FixLinearTriatomic``: its closed forms, per triple, vectorised.

ASE visits one structure's bonds in order, each update seeing the ones
before it (Gauss–Seidel). Bonds that share no atom commute, so the bonds are
put in *levels*: a bond's level is one more than the highest level of an
earlier bond sharing an atom with it. Level by level, all bonds of that
level in all structures are updated at once, which is ASE's sequence of
updates exactly. A sweep is every level once; a structure stops when a sweep
changed none of its bonds, or fails after its constraint's ``maxiter``
sweeps (ASE raises ``RuntimeError('Did not converge')`` there; here the
structure is reported by index and the others go on). Bond lists with more
than :data:`MAX_ORDERED_LEVELS` levels (long chains listed in order) are
coloured greedily instead: fewer levels, a different order of the same
updates, the same tolerance.

Atoms frozen by ``FixAtoms`` (nvalchemi's frozen category) take no share of
a correction (zero inverse mass); ASE would move them. Python loops run over
the bonds only once, when the constraints are read; a step loops over
sweeps and levels only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product

import numpy as np
import torch
from ase import Atoms
from ase.constraints import FixBondLengths, FixLinearTriatomic

__all__ = [
    "MAX_ORDERED_LEVELS",
    "BondConstraints",
    "Geometry",
    "LinearTriatomics",
    "bond_constraints",
    "linear_triatomics",
    "minimum_image",
]

#: Most levels kept in ASE's own order; beyond, bonds are coloured greedily.
MAX_ORDERED_LEVELS = 16

# On an accelerator the "anything still running" test reads back to the host;
# it is asked every few sweeps (a converged structure's sweep changes nothing).
_SWEEPS_PER_CHECK_ON_DEVICE = 4

_IMAGE_SHIFTS = np.array(list(product((-1, 0, 1), repeat=3)), dtype=np.float64)


@dataclass
class Geometry:
    """What the minimum-image convention needs: cells [B, 3, 3], pbc [B, 3]."""

    cell: torch.Tensor
    pbc: torch.Tensor


def minimum_image(
    vectors: torch.Tensor, graph: torch.Tensor, geometry: Geometry | None
) -> torch.Tensor:
    """Shortest periodic image of each vector [K, 3] (ASE's ``find_mic``).

    ``graph`` [K] is each vector's structure; without periodic structures
    (``geometry`` None) the vectors come back unchanged. Fractional parts
    are rounded on periodic axes and the 27 neighbouring images compared,
    which is the minimum image for any cell a bond is short against.
    """
    if geometry is None:
        return vectors
    cell = geometry.cell[graph]
    pbc = geometry.pbc[graph]
    inverse = torch.linalg.inv(geometry.cell)[graph]
    fractional = torch.einsum("ka,kab->kb", vectors, inverse)
    shift = torch.where(pbc, torch.round(fractional), 0.0)
    wrapped = vectors - torch.einsum("ka,kab->kb", shift, cell)
    shifts = torch.as_tensor(_IMAGE_SHIFTS, dtype=vectors.dtype, device=vectors.device)
    offsets = torch.where(pbc.unsqueeze(1), shifts.unsqueeze(0), 0.0)  # [K, 27, 3]
    candidates = wrapped.unsqueeze(1) + offsets @ cell
    lengths = (candidates * candidates).sum(dim=-1)
    best = lengths.argmin(dim=1)
    # the unshifted image (13) wherever no other is strictly shorter
    shorter = lengths.gather(1, best.unsqueeze(1)).squeeze(1) < lengths[:, 13]
    best = torch.where(shorter, best, 13)
    return candidates[torch.arange(len(vectors), device=vectors.device), best]


class BondConstraints:
    """All ``FixBondLengths`` bonds of a batch, level-ordered, on the device.

    Parameters
    ----------
    first, second : numpy.ndarray of int, shape (K,)
        Global atom indices of each bond, in each structure's ASE order.
    lengths, tolerances : numpy.ndarray, shape (K,)
        Bond lengths, Å, and ASE's tolerance on ``x`` of each bond.
    graph : numpy.ndarray of int, shape (K,)
        Structure of each bond.
    maxiter : numpy.ndarray of int, shape (B,)
        Sweeps allowed per structure (ASE's ``FixBondLengths.maxiter``).
    masses : torch.Tensor, shape (V,)
        Atomic masses, amu.
    free : torch.Tensor, shape (V,)
        1 for atoms that move, 0 for frozen ones.
    """

    def __init__(
        self,
        first: np.ndarray,
        second: np.ndarray,
        lengths: np.ndarray,
        tolerances: np.ndarray,
        graph: np.ndarray,
        maxiter: np.ndarray,
        masses: torch.Tensor,
        free: torch.Tensor,
    ) -> None:
        levels = _levels(first, second)
        order = np.argsort(levels, kind="stable")
        counts = np.bincount(levels, minlength=int(levels.max()) + 1)
        ends = np.cumsum(counts)
        #: (start, end) of each level in the sorted bond arrays.
        self.level_slices = [
            (int(end - count), int(end))
            for count, end in zip(counts, ends, strict=True)
        ]
        device, dtype = masses.device, masses.dtype

        def tensor(value: np.ndarray, kind: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(value[order], dtype=kind, device=device)

        self.first = tensor(first, torch.long)
        self.second = tensor(second, torch.long)
        self.length = tensor(lengths, dtype)
        self.tolerance = tensor(tolerances, dtype)
        self.graph = tensor(graph, torch.long)
        self.maxiter = torch.as_tensor(maxiter, dtype=torch.long, device=device)
        self._most_sweeps = int(maxiter.max()) if len(maxiter) else 0
        self.num_graphs = len(maxiter)
        self.has_bonds = torch.zeros(self.num_graphs, dtype=torch.bool, device=device)
        self.has_bonds[self.graph] = True
        mass_first, mass_second = masses[self.first], masses[self.second]
        free_first, free_second = free[self.first], free[self.second]
        # ASE: m = 1 / (1/m_a + 1/m_b); a frozen atom has no inverse mass
        inverse = free_first / mass_first + free_second / mass_second
        movable = inverse > 0
        reduced = torch.where(movable, 1.0 / torch.where(movable, inverse, 1.0), 0.0)
        #: μ/m_a and μ/m_b (ASE's ``m / masses[a]``), 0 for frozen atoms, [K, 1].
        self.weight_first = (reduced / mass_first * free_first).unsqueeze(-1)
        self.weight_second = (reduced / mass_second * free_second).unsqueeze(-1)
        #: ``|x|`` above which a bond is corrected (never for two frozen atoms).
        self.threshold = torch.where(movable, self.tolerance, torch.inf)
        self._host_reads = device.type == "cpu"

    def shake(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        geometry: Geometry | None,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``adjust_positions``: move ``new`` [V, 3] (in place) onto the bonds.

        ``old`` [V, 3] are the positions the step started from, ``skip`` [B]
        structures to leave alone. Returns [B] bool, the structures whose
        bonds did not converge within their ``maxiter`` sweeps.
        """
        r0 = old[self.first] - old[self.second]
        d0 = minimum_image(r0, self.graph, geometry)
        squared = self.length * self.length

        def update(start: int, end: int, running: torch.Tensor) -> torch.Tensor:
            a, b = self.first[start:end], self.second[start:end]
            bond0, raw0 = d0[start:end], r0[start:end]
            d1 = new[a] - new[b] - raw0 + bond0
            x = 0.5 * (squared[start:end] - (d1 * d1).sum(1)) / (bond0 * d1).sum(1)
            return self._apply(new, x, bond0, start, end, running)

        return self._iterate(update, skip)

    def rattle(
        self,
        vectors: torch.Tensor,
        positions: torch.Tensor,
        geometry: Geometry | None,
        *,
        as_momenta: bool,
        masses: torch.Tensor,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``adjust_momenta`` (velocities) or ``adjust_forces`` (``as_momenta``).

        ``vectors`` [V, 3] are changed in place: velocities, Å/ASE-time, or
        forces, eV/Å, which ASE adjusts as if they were momenta. Bond vectors
        are those of ``positions`` [V, 3]. Returns [B] bool, the structures
        that did not converge.
        """
        d = minimum_image(
            positions[self.first] - positions[self.second], self.graph, geometry
        )
        squared = self.length * self.length
        if as_momenta:
            scale_first = self.weight_first * masses[self.first].unsqueeze(-1)
            scale_second = self.weight_second * masses[self.second].unsqueeze(-1)
        else:
            scale_first, scale_second = self.weight_first, self.weight_second

        def update(start: int, end: int, running: torch.Tensor) -> torch.Tensor:
            a, b = self.first[start:end], self.second[start:end]
            if as_momenta:
                dv = vectors[a] / masses[a].unsqueeze(-1) - vectors[b] / masses[
                    b
                ].unsqueeze(-1)
            else:
                dv = vectors[a] - vectors[b]
            bond = d[start:end]
            x = -(dv * bond).sum(1) / squared[start:end]
            return self._apply(
                vectors,
                x,
                bond,
                start,
                end,
                running,
                weights=(scale_first[start:end], scale_second[start:end]),
            )

        return self._iterate(update, skip)

    def _apply(
        self,
        target: torch.Tensor,
        x: torch.Tensor,
        bond: torch.Tensor,
        start: int,
        end: int,
        running: torch.Tensor,
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Add ``±x w bond`` where ``|x|`` exceeds the tolerance; return that mask."""
        first_weight, second_weight = weights or (
            self.weight_first[start:end],
            self.weight_second[start:end],
        )
        active = (x.abs() > self.threshold[start:end]) & running
        x = torch.where(active, x, 0.0).unsqueeze(-1)
        target.index_add_(0, self.first[start:end], x * first_weight * bond)
        target.index_add_(0, self.second[start:end], -(x * second_weight) * bond)
        return active

    def _iterate(
        self,
        update: Callable[[int, int, torch.Tensor], torch.Tensor],
        skip: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sweep the levels until every structure converged or ran out of sweeps."""
        running = self.has_bonds.clone()
        if skip is not None:
            running &= ~skip
        failed = torch.zeros_like(running)
        sweeps = torch.zeros_like(self.maxiter)
        every = 1 if self._host_reads else _SWEEPS_PER_CHECK_ON_DEVICE
        active = torch.zeros(len(self.graph), dtype=torch.bool, device=running.device)
        for sweep in range(self._most_sweeps):
            running_bonds = running[self.graph]
            for start, end in self.level_slices:
                active[start:end] = update(start, end, running_bonds[start:end])
            changed = torch.zeros_like(self.maxiter).index_add_(
                0, self.graph, active.long()
            )
            sweeps += running.long()
            still = running & (changed > 0)
            exhausted = still & (sweeps >= self.maxiter)
            failed |= exhausted
            running = still & ~exhausted
            if (sweep + 1) % every == 0 and not bool(running.any()):
                break
        return failed


class LinearTriatomics:
    """All ``FixLinearTriatomic`` triples of a batch, with ASE's constants.

    Parameters
    ----------
    triples : numpy.ndarray of int, shape (T, 3)
        Global indices ``(n, o, m)`` of each molecule ``n–o–m``.
    graph : numpy.ndarray of int, shape (T,)
        Structure of each triple.
    constants : dict of numpy.ndarray
        ``C1`` … ``C4`` [T, 2], ``length`` [T] (``n–m``, Å), masses
        ``mass_n``, ``mass_m``, ``mass_o`` [T] (amu), as ASE's
        ``FixLinearTriatomic.initialize`` computes them.
    device, dtype
        Where the tensors live.
    """

    def __init__(
        self,
        triples: np.ndarray,
        graph: np.ndarray,
        constants: dict[str, np.ndarray],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        def tensor(value: np.ndarray, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.as_tensor(value, dtype=kind, device=device)

        self.n = tensor(triples[:, 0], torch.long)
        self.o = tensor(triples[:, 1], torch.long)
        self.m = tensor(triples[:, 2], torch.long)
        self.graph = tensor(graph, torch.long)
        self.c1, self.c2 = tensor(constants["C1"]), tensor(constants["C2"])
        self.c3, self.c4 = tensor(constants["C3"]), tensor(constants["C4"])
        self.length = tensor(constants["length"])
        self.mass_n = tensor(constants["mass_n"]).unsqueeze(-1)
        self.mass_m = tensor(constants["mass_m"]).unsqueeze(-1)
        self.mass_o = tensor(constants["mass_o"]).unsqueeze(-1)

    def adjust_positions(
        self, old: torch.Tensor, new: torch.Tensor, geometry: Geometry | None
    ) -> None:
        """ASE's ``adjust_positions`` on ``new`` [V, 3], in place (closed form).

        The central atom is put on the line ``n–m`` of the minimum image; where
        the molecule crosses a periodic boundary ASE also wraps it into the
        cell, here it stays next to ``n`` (the same position modulo a lattice
        vector).
        """
        r0 = old[self.n] - old[self.m]
        d0 = minimum_image(r0, self.graph, geometry)
        new_n, new_m = new[self.n], new[self.m]
        d1 = new_n - new_m - r0 + d0
        a = (d0 * d0).sum(1)
        b = (d1 * d0).sum(1)
        c = (d1 * d1).sum(1) - self.length**2
        g = (b - (b**2 - a * c) ** 0.5) / (a * self.c3.sum(dim=1))
        g = g.unsqueeze(-1) * self.c3
        new_n = new_n - g[:, 0, None] * d0
        new_m = new_m + g[:, 1, None] * d0
        direct = self.c1[:, 0, None] * new_n + self.c1[:, 1, None] * new_m
        image = new_n - self.c1[:, 1, None] * minimum_image(
            new_n - new_m, self.graph, geometry
        )
        crossed = (d0 != r0).any(dim=1, keepdim=True)
        new[self.n] = new_n
        new[self.m] = new_m
        new[self.o] = torch.where(crossed, image, direct)

    def adjust_velocities(
        self,
        velocities: torch.Tensor,
        positions: torch.Tensor,
        geometry: Geometry | None,
    ) -> None:
        """ASE's ``adjust_momenta``, on velocities [V, 3] in place."""
        d = minimum_image(positions[self.n] - positions[self.m], self.graph, geometry)
        p_n = velocities[self.n] * self.mass_n
        p_m = velocities[self.m] * self.mass_m
        dv = p_n / self.mass_n - p_m / self.mass_m
        k = (dv * d).sum(1) / self.length**2
        k = self.c3 / self.c3.sum(dim=1, keepdim=True) * k.unsqueeze(-1)
        p_n = p_n - k[:, 0, None] * self.mass_n * d
        p_m = p_m + k[:, 1, None] * self.mass_m * d
        p_o = self.mass_o * (
            self.c1[:, 0, None] * p_n / self.mass_n
            + self.c1[:, 1, None] * p_m / self.mass_m
        )
        velocities[self.n] = p_n / self.mass_n
        velocities[self.m] = p_m / self.mass_m
        velocities[self.o] = p_o / self.mass_o

    def adjust_forces(
        self, forces: torch.Tensor, positions: torch.Tensor, geometry: Geometry | None
    ) -> None:
        """ASE's ``adjust_forces`` (optimizers), on forces [V, 3] in place."""
        c1, c4 = self.c1, self.c4
        weights = c4 * torch.diff(c1, dim=1)
        weights = torch.stack((-weights[:, 0], weights[:, 1]), dim=1) - 1
        central = torch.diff(c4, dim=1) / weights.sum(dim=1, keepdim=True)
        weights = weights / weights.sum(dim=1, keepdim=True)
        fr_n, fr_m, fr_o = self._redistributed_for_optimization(forces)
        d = minimum_image(positions[self.n] - positions[self.m], self.graph, geometry)
        k = -((fr_n - fr_m) * d).sum(1) / self.length**2
        k = k.unsqueeze(-1)
        forces[self.n] = fr_n + k * d * weights[:, 0, None]
        forces[self.m] = fr_m - k * d * weights[:, 1, None]
        forces[self.o] = fr_o + k * d * central

    def redistribute_md(self, forces: torch.Tensor) -> None:
        """ASE's ``redistribute_forces_md`` (deterministic forces), in place."""
        f_n, f_m, f_o = forces[self.n], forces[self.m], forces[self.o]
        c1_1, c1_2 = self.c1[:, 0, None], self.c1[:, 1, None]
        c2_1, c2_2 = self.c2[:, 0, None], self.c2[:, 1, None]
        mass_n, mass_m, mass_o = self.mass_n, self.mass_m, self.mass_o
        fr_n = (1 - c1_1 * c2_1 * mass_o * mass_m) * f_n - c2_1 * (
            c1_2 * mass_o * mass_n * f_m - mass_m * mass_n * f_o
        )
        fr_m = (1 - c1_2 * c2_2 * mass_o * mass_n) * f_m - c2_2 * (
            c1_1 * mass_o * mass_m * f_n - mass_m * mass_n * f_o
        )
        forces[self.n] = fr_n
        forces[self.m] = fr_m
        forces[self.o] = 0.0

    def _redistributed_for_optimization(
        self, forces: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f_n, f_m, f_o = forces[self.n], forces[self.m], forces[self.o]
        c1_1, c1_2 = self.c1[:, 0, None], self.c1[:, 1, None]
        c4_1, c4_2 = self.c4[:, 0, None], self.c4[:, 1, None]
        fr_n = (1 - c4_1 * c1_1) * f_n - c4_1 * (c1_2 * f_m - f_o)
        fr_m = (1 - c4_2 * c1_2) * f_m - c4_2 * (c1_1 * f_n - f_o)
        fr_o = (1 - 1 / (c1_1**2 + c1_2**2 + 1)) * f_o + c4_1 * f_n + c4_2 * f_m
        return fr_n, fr_m, fr_o


def bond_constraints(
    images: Sequence[Atoms],
    offsets: np.ndarray,
    masses: torch.Tensor,
    free: torch.Tensor,
) -> BondConstraints | None:
    """Read every structure's ``FixBondLengths`` (None when there is none).

    A constraint without ``bondlengths`` takes the structure's current
    distances (minimum image) and keeps them, as ASE's does on its first use.
    Several ``FixBondLengths`` of one structure are iterated together.
    """
    firsts, seconds, lengths, tolerances, graphs = [], [], [], [], []
    maxiter = np.zeros(len(images), dtype=np.int64)
    for graph, (atoms, offset) in enumerate(zip(images, offsets, strict=True)):
        for constraint in atoms.constraints:
            if type(constraint) is not FixBondLengths:
                continue
            pairs = _checked_indices(constraint.pairs, 2, len(atoms), graph, "pairs")
            if not len(pairs):
                continue
            if constraint.bondlengths is None:
                constraint.bondlengths = constraint.initialize_bond_lengths(atoms)
            bond_lengths = np.asarray(constraint.bondlengths, dtype=np.float64)
            if bond_lengths.shape != (len(pairs),):
                raise ValueError(
                    f"images[{graph}]: FixBondLengths has {len(pairs)} pairs and "
                    f"{bond_lengths.size} bondlengths; give one length per pair"
                )
            firsts.append(pairs[:, 0] + offset)
            seconds.append(pairs[:, 1] + offset)
            lengths.append(bond_lengths)
            tolerances.append(np.full(len(pairs), float(constraint.tolerance)))
            graphs.append(np.full(len(pairs), graph))
            maxiter[graph] = max(maxiter[graph], int(constraint.maxiter))
    if not firsts:
        return None
    return BondConstraints(
        np.concatenate(firsts),
        np.concatenate(seconds),
        np.concatenate(lengths),
        np.concatenate(tolerances),
        np.concatenate(graphs),
        maxiter,
        masses,
        free,
    )


def linear_triatomics(
    images: Sequence[Atoms],
    offsets: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
) -> LinearTriatomics | None:
    """Read every structure's ``FixLinearTriatomic`` (None when there is none).

    The constants are ASE's own (``FixLinearTriatomic.initialize``, run on the
    structure when the constraint has not been used yet, as ASE's first use
    does).
    """
    triples, graphs = [], []
    constants: dict[str, list[np.ndarray]] = {
        key: []
        for key in ("C1", "C2", "C3", "C4", "length", "mass_n", "mass_m", "mass_o")
    }
    for graph, (atoms, offset) in enumerate(zip(images, offsets, strict=True)):
        for constraint in atoms.constraints:
            if type(constraint) is not FixLinearTriatomic:
                continue
            indices = _checked_indices(
                constraint.triples, 3, len(atoms), graph, "triples"
            )
            if not len(indices):
                continue
            if constraint.bondlengths is None:
                constraint.initialize(atoms)
            triples.append(indices + offset)
            graphs.append(np.full(len(indices), graph))
            for key in ("C1", "C2", "C3", "C4"):
                constants[key].append(np.asarray(getattr(constraint, key)))
            constants["length"].append(np.asarray(constraint.bondlengths_nm))
            for key in ("mass_n", "mass_m", "mass_o"):
                constants[key].append(np.asarray(getattr(constraint, key)))
    if not triples:
        return None
    return LinearTriatomics(
        np.concatenate(triples),
        np.concatenate(graphs),
        {key: np.concatenate(value) for key, value in constants.items()},
        device,
        dtype,
    )


def _checked_indices(
    raw: object, width: int, count: int, graph: int, field: str
) -> np.ndarray:
    """Atom indices [K, width] of a constraint, checked against the structure."""
    indices = np.asarray(raw, dtype=np.int64).reshape(-1, width)
    if indices.size and (indices.min() < -count or indices.max() >= count):
        raise ValueError(
            f"images[{graph}]: a {field} index of its constraint is outside its "
            f"{count} atoms; build the constraint on this structure"
        )
    return indices % count if indices.size else indices


def _levels(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Level of each bond: after every earlier bond sharing an atom (ASE's order).

    With more than :data:`MAX_ORDERED_LEVELS` levels, greedy colours instead
    (bonds sharing an atom never share a colour).
    """
    last: dict[int, int] = {}
    levels = np.zeros(len(first), dtype=np.int64)
    for bond, (a, b) in enumerate(zip(first.tolist(), second.tolist(), strict=True)):
        level = max(last.get(a, -1), last.get(b, -1)) + 1
        levels[bond] = last[a] = last[b] = level
    if len(levels) == 0 or levels.max() < MAX_ORDERED_LEVELS:
        return levels
    used: dict[int, set[int]] = {}
    for bond, (a, b) in enumerate(zip(first.tolist(), second.tolist(), strict=True)):
        taken = used.setdefault(a, set()) | used.setdefault(b, set())
        colour = next(c for c in range(len(taken) + 1) if c not in taken)
        levels[bond] = colour
        used[a].add(colour)
        used[b].add(colour)
    return levels
