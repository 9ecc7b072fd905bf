"""How much a working batch may hold: atoms, edges, estimated memory, structures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ase import Atoms

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.models.memory import MemoryEstimate
    from nvalchemi_ase.runners.throughput import ThroughputProfile

__all__ = ["Budget"]


@dataclass
class Budget:
    """How much the working batch may hold.

    Attributes
    ----------
    max_atoms : int or None
        Atoms.
    max_edges : int or None
        Ordered pairs within ``cutoff``.
    max_bytes : float or None
        Bytes of the memory estimate (used when neither count is given).
    estimate : MemoryEstimate or None
        The model's estimate (with ``max_bytes``).
    cutoff : float or None
        Edge cutoff, Å.
    max_structures : int or None
        Structures.
    available : int or None
        Free memory when the budget was made, bytes (with ``max_bytes``).
    profile : ThroughputProfile or None
        The throughput probe's result once taken (see :meth:`for_calculator`);
        ``profile.describe()`` says what it measured and what it cost.
    tuned_max_atoms, tuned_max_edges : int or None
        The probe's fastest batch size, atoms or edges: structures join a
        non-empty batch only within it. Unlike the limits above it refuses
        nothing: a structure larger than it runs alone.
    """

    max_atoms: int | None = None
    max_edges: int | None = None
    max_bytes: float | None = None
    estimate: MemoryEstimate | None = None
    cutoff: float | None = None
    max_structures: int | None = None
    available: int | None = field(default=None, repr=False)
    profile: ThroughputProfile | None = None
    tuned_max_atoms: int | None = None
    tuned_max_edges: int | None = None
    _probe_with: NVAlchemiCalculator | None = field(default=None, repr=False)
    _probe_tries: int = field(default=0, repr=False)

    @classmethod
    def for_calculator(
        cls,
        calc: NVAlchemiCalculator,
        max_atoms: int | None,
        max_edges: int | None,
        max_structures: int | None = None,
        *,
        sharers: int = 1,
        probe: bool | None = None,
    ) -> Budget:
        """Build the budget for ``calc``'s model: the counts given, else memory.

        ``sharers`` processes share the device's memory (ranks of a
        distributed run on one CPU or GPU): each gets that fraction of it.

        A memory budget is also tuned for throughput (``probe``; default on
        unless ``$NVALCHEMI_ASE_THROUGHPUT_PROBE=0``): the first structure
        priced with :meth:`cost` that fits is the sample of
        :func:`~nvalchemi_ase.runners.throughput.cached_profile`, and where
        batches larger than the fastest one were measurably slower per atom,
        the budget keeps to the fastest (``max_atoms``, or ``max_edges`` for
        models whose memory grows with edges). Given counts are kept as they
        are: they fix the size by hand.
        """
        from nvalchemi_ase.models.memory import (
            SAFETY_FRACTION,
            available_memory,
            memory_estimate,
        )
        from nvalchemi_ase.runners.throughput import probe_enabled

        for name, value in (
            ("max_atoms", max_atoms),
            ("max_edges", max_edges),
            ("max_structures", max_structures),
        ):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        estimate = memory_estimate(calc.model, calc.dtype, calc.device)
        if max_atoms is not None or max_edges is not None:
            return cls(
                max_atoms,
                max_edges,
                cutoff=estimate.cutoff,
                max_structures=max_structures,
            )
        available = available_memory(calc.device) // max(1, sharers)
        return cls(
            max_bytes=SAFETY_FRACTION * available,
            estimate=estimate,
            cutoff=estimate.cutoff,
            max_structures=max_structures,
            available=available,
            _probe_with=calc if (probe_enabled() if probe is None else probe) else None,
        )

    def cost(self, atoms: Atoms) -> npt.NDArray[np.float64]:
        """(atoms, edges, bytes, 1) one structure takes; counts only what is limited."""
        from nvalchemi_ase.models.memory import count_edges

        natoms = float(len(atoms))
        counted = self.max_edges is not None or (
            self.estimate is not None and self.estimate.bytes_per_edge > 0
        )
        edges = count_edges(atoms, self.cutoff) if counted else 0.0
        memory = (
            0.0 if self.estimate is None else self.estimate.bytes_for(len(atoms), edges)
        )
        cost = np.array([natoms, edges, memory, 1.0])
        if self._probe_with is not None:
            self._tune(atoms, cost)
        return cost

    def _tune(self, sample: Atoms, cost: npt.NDArray[np.float64]) -> None:
        """Take the throughput profile on ``sample`` and keep to its fastest size.

        A sample that does not fit alone is passed over; a probe that fails
        (an invalid structure, say: the run reports it itself) is tried again
        on the next structure, twice at most, and then given up: the budget
        stays a memory budget.
        """
        from nvalchemi_ase.runners.throughput import cached_profile

        calc = self._probe_with
        if calc is None or not self.fits(np.zeros(4), cost):
            return
        copies = float(np.min(self.limits / np.maximum(cost, 1e-300)))
        self._probe_tries += 1
        try:
            profile = cached_profile(calc, sample, max_atoms=copies * cost[0])
        except Exception:  # tuning is optional; the run reports its own errors
            if self._probe_tries >= 3:
                self._probe_with = None
            return
        self._probe_with = None
        self.profile = profile
        cap = profile.cap_atoms()
        if cap is None:
            return
        if (
            cost[1] > 0
            and self.estimate is not None
            and self.estimate.bytes_per_edge > 0
        ):
            self.tuned_max_edges = max(1, int(cap / cost[0] * cost[1]))
        else:
            self.tuned_max_atoms = max(1, cap)

    @property
    def limits(self) -> npt.NDArray[np.float64]:
        """(atoms, edges, bytes, structures) limits; inf where unlimited."""
        return np.array(
            [
                math.inf if value is None else float(value)
                for value in (
                    self.max_atoms,
                    self.max_edges,
                    self.max_bytes,
                    self.max_structures,
                )
            ]
        )

    def fits(
        self, used: npt.NDArray[np.float64], cost: npt.NDArray[np.float64]
    ) -> bool:
        """Whether ``cost`` fits next to ``used`` (``used[3]`` structures so far).

        Within the limits always; within the tuned size too unless the batch
        is empty (a structure larger than the tuned size runs alone).
        """
        total = used + cost
        if not np.all(total <= self.limits):
            return False
        tuned = (self.tuned_max_atoms, self.tuned_max_edges)
        if used[3] == 0 or tuned == (None, None):
            return True
        return all(
            limit is None or total[column] <= limit
            for column, limit in enumerate(tuned)
        )

    def refusal(self, cost: npt.NDArray[np.float64]) -> str | None:
        """Why a structure alone does not fit, or None."""
        from nvalchemi_ase.models.memory import format_bytes

        natoms, edges, memory, _ = cost
        if self.max_atoms is not None and natoms > self.max_atoms:
            return f"{natoms:.0f} atoms exceed max_atoms={self.max_atoms}"
        if self.max_edges is not None and edges > self.max_edges:
            return f"{edges:.0f} edges exceed max_edges={self.max_edges}"
        if self.max_bytes is not None and memory > self.max_bytes:
            return (
                f"needs about {format_bytes(memory)} by the model's memory estimate; "
                f"{format_bytes(self.max_bytes)} may be used "
                f"({format_bytes(self.available or 0)} available)"
            )
        return None
