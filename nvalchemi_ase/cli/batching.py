"""Batches sized from memory, and what to say when one does not fit.

By default a batch holds as many consecutive structures as the model's memory
estimate (:mod:`nvalchemi_ase.models.memory`) lets fit into
:data:`~nvalchemi_ase.models.memory.SAFETY_FRACTION` of the memory free where
the model runs, and at most :data:`DEFAULT_MAX_STRUCTURES` structures.
``--max-atoms`` replaces the memory rule by an atom count (no memory check),
``--batch-size`` the structure cap.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nvalchemi_ase.cli.common import CommandError, Source

__all__ = [
    "DEFAULT_MAX_STRUCTURES",
    "BatchPlan",
    "Chunk",
    "is_out_of_memory",
    "out_of_memory_message",
    "plan_batches",
]

#: Structures per batch unless ``--batch-size`` says otherwise (one open
#: trajectory file per structure, and progress every batch).
DEFAULT_MAX_STRUCTURES = 512


@dataclass
class Chunk:
    """One batch of consecutive inputs.

    Attributes
    ----------
    number : int
        1-based position among the batches.
    total : int
        Number of batches.
    items : list of (int, Source)
        Global input index and source of each structure.
    estimated_bytes : float or None
        Estimated peak memory, bytes (None when not sized from memory).
    """

    number: int
    total: int
    items: list[tuple[int, Source]]
    estimated_bytes: float | None = None

    @property
    def atoms(self) -> int:
        """Atoms in the batch."""
        return sum(len(source.atoms) for _, source in self.items)

    @property
    def largest(self) -> int:
        """Atoms of its largest structure."""
        return max(len(source.atoms) for _, source in self.items)

    def describe(self) -> str:
        """E.g. ``"batch 2/4 (in.xyz@16 to in.xyz@31, 16 structures, 512 atoms)"``."""
        first, last = self.items[0][1].label, self.items[-1][1].label
        frames = first if len(self.items) == 1 else f"{first} to {last}"
        count = len(self.items)
        noun = "structure" if count == 1 else "structures"
        return (
            f"batch {self.number}/{self.total} ({frames}, {count} {noun}, "
            f"{self.atoms} atoms)"
        )


@dataclass
class BatchPlan:
    """The batches of a run and the memory figures they were sized with.

    Attributes
    ----------
    chunks : list of Chunk
        In input order.
    device : str
        Where the model runs.
    available : int or None
        Free memory there at planning time, bytes (None: ``--max-atoms`` given).
    budget : float or None
        Bytes a batch may be estimated to need.
    estimate : MemoryEstimate or None
        The model's estimate.
    """

    chunks: list[Chunk] = field(default_factory=list)
    device: str = "cpu"
    available: int | None = None
    budget: float | None = None
    estimate: Any = None


def plan_batches(
    args: argparse.Namespace, calc: Any, sources: Sequence[Source]
) -> BatchPlan:
    """Split the inputs into batches within memory (or the given limits).

    Parameters
    ----------
    args : argparse.Namespace
        ``batch_size`` and ``max_atoms`` (None: from memory).
    calc : NVAlchemiCalculator
        Its model, dtype and device give the estimate.
    sources : sequence of Source
        All inputs, in order.

    Returns
    -------
    BatchPlan
        The batches.

    Raises
    ------
    CommandError
        If one structure alone is estimated to need more than the budget (it is
        named, with its atoms, the estimate and the memory available).
    """
    max_structures = args.batch_size or DEFAULT_MAX_STRUCTURES
    device = str(calc.device)
    if args.max_atoms is not None:
        sizes = [float(len(s.atoms)) for s in sources]
        groups = _group(sizes, max_structures, float(args.max_atoms))
        return BatchPlan(_chunks(sources, groups, None), device)
    from nvalchemi_ase.models.memory import (
        SAFETY_FRACTION,
        available_memory,
        count_edges,
        memory_estimate,
    )

    estimate = memory_estimate(calc.model, calc.dtype, calc.device)
    available = available_memory(calc.device)
    budget = SAFETY_FRACTION * available
    costs = [
        estimate.bytes_for(len(s.atoms), count_edges(s.atoms, estimate.cutoff))
        for s in sources
    ]
    for source, cost in zip(sources, costs, strict=True):
        if cost > budget:
            raise CommandError(_too_large(source, cost, available, budget, device))
    groups = _group(costs, max_structures, budget)
    return BatchPlan(
        _chunks(sources, groups, costs), device, available, budget, estimate
    )


def _group(
    costs: Sequence[float], max_structures: int, budget: float
) -> list[list[int]]:
    """Consecutive groups of indices within ``max_structures`` and ``budget``."""
    groups: list[list[int]] = []
    current: list[int] = []
    spent = 0.0
    for index, cost in enumerate(costs):
        if current and (len(current) >= max_structures or spent + cost > budget):
            groups.append(current)
            current, spent = [], 0.0
        current.append(index)
        spent += cost
    if current:
        groups.append(current)
    return groups


def _chunks(
    sources: Sequence[Source],
    groups: list[list[int]],
    costs: Sequence[float] | None,
) -> list[Chunk]:
    return [
        Chunk(
            number,
            len(groups),
            [(i, sources[i]) for i in group],
            None if costs is None else sum(costs[i] for i in group),
        )
        for number, group in enumerate(groups, start=1)
    ]


def _too_large(
    source: Source, cost: float, available: int, budget: float, device: str
) -> str:
    from nvalchemi_ase.models.memory import SAFETY_FRACTION, format_bytes

    return (
        f"{source.label} ({len(source.atoms)} atoms) needs about "
        f"{format_bytes(cost)} by the model's memory estimate, but {device} has "
        f"{format_bytes(available)} available (batches may use "
        f"{SAFETY_FRACTION:.0%}: {format_bytes(budget)}); run it on a machine "
        "or device with more memory, or pass --max-atoms to skip this check"
    )


# -- out of memory during a run -----------------------------------------------------


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (torch, CUDA, Warp, Python).

    Parameters
    ----------
    error : BaseException
        Anything raised during a batch.

    Returns
    -------
    bool
        True for ``MemoryError``, ``torch.OutOfMemoryError`` and a
        ``RuntimeError`` whose message says "out of memory" or that an
        allocation failed.
    """
    import sys

    torch = sys.modules.get("torch")
    oom_types: tuple[type[BaseException], ...] = (MemoryError,)
    if torch is not None:
        oom_types += tuple(
            t
            for t in (
                getattr(torch, "OutOfMemoryError", None),
                getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
            )
            if isinstance(t, type)
        )
    if isinstance(error, oom_types):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return "out of memory" in text or (
        "alloc" in text
        and any(word in text for word in ("fail", "can't", "cannot", "unable"))
    )


def out_of_memory_message(
    chunk: Chunk, plan: BatchPlan, error: BaseException, where: str
) -> str:
    """One line naming the batch that ran out of memory and the limit to use.

    Parameters
    ----------
    chunk : Chunk
        The batch.
    plan : BatchPlan
        For the memory figures.
    error : BaseException
        The allocation failure (its first line is quoted).
    where : str
        Where the results so far are.

    Returns
    -------
    str
        The message.
    """
    from nvalchemi_ase.models.memory import format_bytes

    figures = ""
    if chunk.estimated_bytes is not None and plan.available is not None:
        figures = (
            f"; estimated {format_bytes(chunk.estimated_bytes)}, "
            f"{format_bytes(plan.available)} were available"
        )
    if len(chunk.items) == 1:
        advice = (
            f"{chunk.items[0][1].label} alone does not fit on {plan.device}: use a "
            "device with more memory"
        )
    else:
        advice = f"rerun with --max-atoms {suggested_max_atoms(chunk)}"
    cause = (str(error).strip().splitlines() or [""])[0][:200]
    return (
        f"out of memory on {plan.device} in {chunk.describe()}{figures}: {advice} "
        f"({type(error).__name__}: {cause}); {where}"
    )


def suggested_max_atoms(chunk: Chunk) -> int:
    """Half the batch's atoms, but no fewer than its largest structure.

    Parameters
    ----------
    chunk : Chunk
        The batch that did not fit.

    Returns
    -------
    int
        A ``--max-atoms`` value.
    """
    return max(chunk.largest, chunk.atoms // 2)
