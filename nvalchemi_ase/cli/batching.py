"""Working batches sized from memory, the inputs checked first, and out of memory.

``calc``, ``relax`` and ``md`` run on :mod:`nvalchemi_ase.runners`: a working
batch holds as many structures as the model's memory estimate
(:mod:`nvalchemi_ase.models.memory`) lets fit into
:data:`~nvalchemi_ase.models.memory.SAFETY_FRACTION` of the memory free where
the model runs, and at most :data:`DEFAULT_MAX_STRUCTURES` structures.
``--max-atoms`` replaces the memory rule by an atom count (no memory check),
``--batch-size`` the structure cap.

Before any model call :func:`scan_inputs` reads every input frame once, one at
a time, checks it for the model and against the budget, and keeps only where
it came from and its size: a bad frame or one too large to fit ends the run
there, naming ``file@frame``, before any work.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from nvalchemi_ase.cli.common import CommandError, Source

__all__ = [
    "DEFAULT_MAX_STRUCTURES",
    "Inputs",
    "budget_for",
    "is_out_of_memory",
    "labelled_atoms",
    "out_of_memory_message",
    "scan_inputs",
]

#: Structures in the working batch unless ``--batch-size`` says otherwise (one
#: open trajectory file per structure in flight).
DEFAULT_MAX_STRUCTURES = 512


@dataclass
class Inputs:
    """What a run's inputs are, without their structures.

    Attributes
    ----------
    paths : list of str
        The input files (``file@slice`` allowed), as :func:`expand_inputs` gave.
    labels : list of str
        ``file@frame`` of each input structure, in input order (its index).
    natoms : list of int
        Atoms of each.
    estimated_bytes : list of float or None
        Each one's estimated memory need (None when not sized from memory).
    budget : Budget
        The working-batch budget the structures were checked against.
    device : str
        Where the model runs.
    """

    paths: list[str]
    labels: list[str] = field(default_factory=list)
    natoms: list[int] = field(default_factory=list)
    estimated_bytes: list[float] | None = None
    budget: Any = None
    device: str = "cpu"

    def __len__(self) -> int:
        return len(self.labels)

    def describe(self, indices: Sequence[int]) -> str:
        """E.g. ``"a batch of 16 structures, 512 atoms (in.xyz@3, in.xyz@5, ...)"``."""
        count = len(indices)
        atoms = sum(self.natoms[i] for i in indices)
        names = ", ".join(self.labels[i] for i in indices[:3])
        if count > 3:
            names += f" and {count - 3} more"
        noun = "structure" if count == 1 else "structures"
        return f"a batch of {count} {noun}, {atoms} atoms ({names})"


def budget_for(args: argparse.Namespace, calc: Any) -> Any:
    """Return the runners' budget the options describe (see the module docstring)."""
    from nvalchemi_ase.runners import Budget

    return Budget.for_calculator(
        calc,
        args.max_atoms,
        None,
        args.batch_size or DEFAULT_MAX_STRUCTURES,
        probe=False if getattr(args, "command", None) == "md" else None,
    )


def scan_inputs(
    paths: Sequence[str],
    calc: Any,
    args: argparse.Namespace,
    *,
    skin: float | None = None,
) -> Inputs:
    """Read every input frame once, check it, and keep its label and size.

    Parameters
    ----------
    paths : sequence of str
        Files from :func:`~nvalchemi_ase.cli.common.expand_inputs`.
    calc : NVAlchemiCalculator
        The model the structures are checked for.
    args : argparse.Namespace
        ``max_atoms`` and ``batch_size`` (None: from memory).
    skin : float, optional
        Verlet skin the run adds to the model's cutoff, Å (default: the
        dynamics' :data:`~nvalchemi_ase.dynamics.base.DEFAULT_SKIN`; 0 for
        single points).

    Returns
    -------
    Inputs
        Labels, sizes and the budget, in input order.

    Raises
    ------
    CommandError
        For a file that cannot be read, no structure at all, a structure the
        model cannot run (``file@frame``, the field and the fix), or one too
        large for the budget (its atoms, the estimate and the memory).
    """
    from nvalchemi_ase.cli.common import iter_sources, say, structure_message
    from nvalchemi_ase.convert import StructureError, check_images
    from nvalchemi_ase.dynamics.base import DEFAULT_SKIN

    budget = budget_for(args, calc)
    inputs = Inputs(
        list(paths),
        estimated_bytes=None if budget.max_bytes is None else [],
        budget=budget,
        device=str(calc.device),
    )
    for source in iter_sources(paths):
        try:
            check_images(
                [source.atoms],
                model=calc.model,
                skin=DEFAULT_SKIN if skin is None else skin,
            )
        except StructureError as error:
            raise CommandError(structure_message(source, error)) from error
        cost = budget.cost(source.atoms)
        if budget.refusal(cost) is not None:
            raise CommandError(_too_large(source, cost, budget, inputs.device))
        inputs.labels.append(source.label)
        inputs.natoms.append(len(source.atoms))
        if inputs.estimated_bytes is not None:
            inputs.estimated_bytes.append(float(cost[2]))
    if not inputs.labels:
        raise CommandError("no structures in the input files")
    if budget.profile is not None:
        say(args, f"batch size: {budget.profile.describe()}")
    return inputs


def labelled_atoms(paths: Sequence[str]) -> Iterator[Any]:
    """Yield the input structures one at a time, ``info["source"]`` = ``file@frame``."""
    from nvalchemi_ase.cli.common import iter_sources

    for source in iter_sources(paths):
        source.atoms.info["source"] = source.label
        yield source.atoms


def _too_large(source: Source, cost: Any, budget: Any, device: str) -> str:
    from nvalchemi_ase.models.memory import SAFETY_FRACTION, format_bytes

    atoms = len(source.atoms)
    if budget.max_atoms is not None:
        return (
            f"{source.label} has {atoms} atoms, more than --max-atoms "
            f"{budget.max_atoms}; raise --max-atoms to at least {atoms}"
        )
    available = budget.available or 0
    return (
        f"{source.label} ({atoms} atoms) needs about "
        f"{format_bytes(cost[2])} by the model's memory estimate, but {device} has "
        f"{format_bytes(available)} available (batches may use "
        f"{SAFETY_FRACTION:.0%}: {format_bytes(budget.max_bytes or 0)}); run it on "
        "a machine or device with more memory, or pass --max-atoms to skip this "
        "check"
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
    inputs: Inputs, indices: Sequence[int] | None, error: BaseException, where: str
) -> str:
    """One line naming the batch that ran out of memory and the limit to use.

    Parameters
    ----------
    inputs : Inputs
        Labels, sizes and memory figures.
    indices : sequence of int or None
        Input indices of the structures in the batch (the error's
        ``input_indices``; None when the runner did not say).
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

    cause = (str(error).strip().splitlines() or [""])[0][:200]
    device = inputs.device
    if not indices:
        return (
            f"out of memory on {device}: rerun with a smaller --max-atoms "
            f"({type(error).__name__}: {cause}); {where}"
        )
    figures = ""
    if inputs.estimated_bytes is not None and inputs.budget.available is not None:
        estimated = sum(inputs.estimated_bytes[i] for i in indices)
        figures = (
            f"; estimated {format_bytes(estimated)}, "
            f"{format_bytes(inputs.budget.available)} were available"
        )
    if len(indices) == 1:
        advice = (
            f"{inputs.labels[indices[0]]} alone does not fit on {device}: use a "
            "device with more memory"
        )
    else:
        advice = f"rerun with --max-atoms {suggested_max_atoms(inputs, indices)}"
    return (
        f"out of memory on {device} in {inputs.describe(indices)}{figures}: "
        f"{advice} ({type(error).__name__}: {cause}); {where}"
    )


def suggested_max_atoms(inputs: Inputs, indices: Sequence[int]) -> int:
    """Half the batch's atoms, but no fewer than its largest structure.

    Parameters
    ----------
    inputs : Inputs
        The sizes.
    indices : sequence of int
        The batch that did not fit.

    Returns
    -------
    int
        A ``--max-atoms`` value.
    """
    sizes = [inputs.natoms[i] for i in indices]
    return max(max(sizes), sum(sizes) // 2)
