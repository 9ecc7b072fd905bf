"""What the runners share: slots, admission checks, results, helpers."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.runners.files import read_results

if TYPE_CHECKING:
    from pathlib import Path

    from ase import Atoms

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.convert import CheckedImages
    from nvalchemi_ase.identity import Job
    from nvalchemi_ase.runners.budget import Budget
    from nvalchemi_ase.runners.distributed import Shard
    from nvalchemi_ase.runners.files import Sink

__all__ = [
    "NO_LIMIT",
    "PROPERTIES",
    "Admission",
    "CountedInputs",
    "Run",
    "Slot",
    "calculator_for",
    "check_written_first",
    "checked_properties",
    "failed_atoms",
    "final_values",
    "in_input_order",
    "naming_inputs",
    "opened_run",
    "progress_bar",
    "quiet_failures",
    "result_atoms",
]


#: Result properties the runners can write (``stress`` for cells of rank 3).
PROPERTIES = ("energy", "forces", "stress")


@dataclass
class Run:
    """What one runner call works with: its shard, calculator, budget and sink."""

    shard: Shard
    calc: NVAlchemiCalculator
    budget: Budget
    sink: Sink


@contextlib.contextmanager
def opened_run(
    model: Any,
    *,
    distributed: bool | None,
    device: Any = None,
    dtype: Any = None,
    max_atoms: int | None = None,
    max_edges: int | None = None,
    max_structures: int | None = None,
    output: str | Path | None = None,
    resume: bool = False,
    failures: str | Path | None = None,
    probe: bool | None = None,
    job: tuple[str, dict[str, Any], tuple[str, ...]] | None = None,
) -> Iterator[Run]:
    """Open one runner call: this process's shard, calculator, budget, output.

    ``probe`` is the budget's throughput tuning (None: its default; see
    :meth:`~nvalchemi_ase.runners.budget.Budget.for_calculator`).

    The output is finished (shard files merged) when the block ends normally;
    on an error or an abandoned generator it is only closed, so that
    ``resume=True`` continues from what was written. ``job``: the kind of
    run, its result-determining parameters and the structure fields it
    depends on, stored with every frame written (:mod:`nvalchemi_ase.identity`).
    """
    from nvalchemi_ase.runners.budget import Budget
    from nvalchemi_ase.runners.distributed import sharding
    from nvalchemi_ase.runners.files import Sink

    with sharding(distributed) as shard:
        calc = calculator_for(model, shard.device(device), dtype)
        budget = Budget.for_calculator(
            calc,
            max_atoms,
            max_edges,
            max_structures,
            sharers=shard.memory_sharers(calc.device),
            probe=probe,
        )
        sink = Sink(output, resume, failures, shard, job=job_of(calc, job, output))
        try:
            yield Run(shard, calc, budget, sink)
            sink.finish()
        finally:
            sink.close()


def job_of(
    calc: NVAlchemiCalculator,
    job: tuple[str, dict[str, Any], tuple[str, ...]] | None,
    output: str | Path | None,
) -> Job | None:
    """Return the identity of a runner call writing ``output`` (or None)."""
    if job is None or output is None:
        return None
    from nvalchemi_ase.identity import Job, model_digest, run_digest

    kind, parameters, fields = job
    return Job(
        model=model_digest(calc.model, calc.dtype),
        run=run_digest(kind, parameters),
        fields=fields,
    )


class CountedInputs:
    """An iterable of inputs that counts the structures read from it."""

    def __init__(self, structures: Iterable[Atoms]) -> None:
        self._structures = structures
        self.count = 0

    def __iter__(self) -> Iterator[Atoms]:
        for atoms in self._structures:
            self.count += 1
            yield atoms

    @property
    def source(self) -> Iterable[Atoms]:
        """The structures as given (a list has a length for progress bars)."""
        return self._structures


def check_written_first(run: Run, structures: Iterable[Atoms]) -> None:
    """With a list of inputs, compare every written result with its input first.

    A resumed run then refuses another job's output before any work; a stream
    is checked as it is read (:meth:`~nvalchemi_ase.runners.files.Sink.identify`).
    """
    source = structures.source if isinstance(structures, CountedInputs) else structures
    if not run.sink.done or not isinstance(source, Sequence):
        return
    indices = sorted(
        index
        for index in run.sink.done
        if index < len(source) and run.shard.owns(index)
    )
    for start in range(0, len(indices), _CHECK_CHUNK):
        part = indices[start : start + _CHECK_CHUNK]
        run.sink.identify(part, [source[index] for index in part])


#: Structures digested together when written results are checked up front.
_CHECK_CHUNK = 4096


def in_input_order(
    results: Iterator[tuple[int, Atoms]],
    kwargs: dict[str, Any],
    inputs: CountedInputs | None = None,
) -> list[Atoms]:
    """Every rank's results, with ``resume`` those read back too, by index.

    ``results`` is the runner's generator, not started yet: it runs inside
    this function's shard (so a process group the runners start lasts until
    every rank has its results). ``inputs``: the counted inputs the runner
    read; results read back for indices past them (an output of more inputs
    than given) are not returned.
    """
    from nvalchemi_ase.runners.distributed import sharding

    with sharding(kwargs.get("distributed")) as shard:
        found = dict(shard.gather(list(results)))
        if kwargs.get("resume") and kwargs.get("output") is not None:
            failures = kwargs.get("failures") or True
            limit = None if inputs is None else inputs.count
            for atoms in read_results(kwargs["output"], failures=failures):
                index = int(atoms.info["index"])
                if limit is None or index < limit:
                    found.setdefault(index, atoms)
    return [found[index] for index in sorted(found)]


@dataclass
class Slot:
    """One structure in (or about to enter) the working batch."""

    index: int
    atoms: Atoms  # the runner's own working copy
    cost: npt.NDArray[np.float64]
    steps: int = 0
    trajectory: Any = None  # its open ase Trajectory, while in flight
    series: list[tuple[float, float]] | None = None  # (E/atom, fmax) per step
    identity: npt.NDArray[np.uint64] | None = None  # digests of the input as given


class Admission:
    """Why a structure cannot be run at all (checked once, at admission), or None."""

    def __init__(self, model: Any, skin: float | None) -> None:
        from nvalchemi_ase.dynamics.base import DEFAULT_SKIN

        self._model = model
        self._skin = DEFAULT_SKIN if skin is None else float(skin)

    def __call__(self, atoms: Atoms) -> str | None:
        from nvalchemi_ase.convert import StructureError, check_images
        from nvalchemi_ase.dynamics.images import check_constraints

        try:
            check_images([atoms], model=self._model, skin=self._skin)
            check_constraints([atoms])
        except StructureError as error:
            return f"{error.field}: {str(error).split(': ', 1)[1]}"
        except (ValueError, TypeError) as error:
            return str(error).replace("images[0] ", "it ")
        return None

    def refusals(self, images: list[Atoms]) -> list[str | None]:
        """:meth:`__call__` of each structure, checked all at once when all pass.

        One vectorised check of many structures costs about what one of a
        single structure does (0.1 against 0.8 ms a structure for 15 argon
        cells); only when it finds a problem is each structure checked on its
        own, for its own reason.
        """
        return self.checked(images)[0]

    def checked(
        self, images: list[Atoms]
    ) -> tuple[list[str | None], CheckedImages | None]:
        """:meth:`refusals`, and the checked structures when all of them pass.

        The :class:`~nvalchemi_ase.convert.CheckedImages` (None when one is
        refused) builds their batch without converting them again
        (:func:`~nvalchemi_ase.convert.batch_from_checked`).
        """
        from nvalchemi_ase.convert import check_images
        from nvalchemi_ase.dynamics.images import check_constraints

        if not images:
            return [], None
        try:
            checked = check_images(images, model=self._model, skin=self._skin)
            check_constraints(images)
        except (ValueError, TypeError):  # StructureError is a ValueError
            return [self(atoms) for atoms in images], None
        return [None] * len(images), checked


#: Step limit passed to the optimizer: the runner enforces per-structure limits.
NO_LIMIT = 1 << 62


def final_values(
    calc: NVAlchemiCalculator,
    images: list[Atoms],
    failed: npt.NDArray[np.bool_],
    *,
    stress: bool,
    results: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Energy (eV), forces [N, 3] (eV/Å) and optionally stress of synced ``Atoms``.

    The dynamics object has written its state and results into ``images``
    (in the user's orientation, also under a cell filter), or its state into
    them and their ``results`` (ASE keys; default: each calculator's). Stress
    (Voigt, eV/Å³, cells of rank 3) that the last step did not compute is
    evaluated in one batched call for the structures that did not fail.
    """
    values = []
    if results is None:
        results = [atoms.calc.results for atoms in images]
    for given in results:
        entry = {
            "energy": float(given["energy"]),
            "forces": np.array(given["forces"], dtype=np.float64),
        }
        if stress and "stress" in given:
            entry["stress"] = np.array(given["stress"], dtype=np.float64)
        values.append(entry)
    if stress:
        missing = [
            k
            for k, atoms in enumerate(images)
            if not failed[k] and atoms.cell.rank == 3 and "stress" not in values[k]
        ]
        if missing:
            evaluated = calc.calculate_batch([images[k] for k in missing], ["stress"])
            for k, result in zip(missing, evaluated, strict=True):
                values[k]["stress"] = np.asarray(result["stress"], dtype=np.float64)
    return values


def result_atoms(
    slot: Slot,
    values: dict[str, Any],
    *,
    converged: bool,
    atoms: Atoms | None = None,
) -> Atoms:
    """Return the result of ``slot``: ``atoms`` (default: a working ``Atoms`` copy)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = slot.atoms.copy() if atoms is None else atoms
    atoms.calc = SinglePointCalculator(atoms, **values)
    atoms.info.update(
        index=slot.index, converged=converged, steps=slot.steps, failure=None
    )
    return atoms


def failed_atoms(
    slot: Slot,
    reason: str,
    results: dict[str, Any] | None,
    atoms: Atoms | None = None,
) -> Atoms:
    """Return the failure of ``slot``: ``atoms`` (default: a working ``Atoms`` copy)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = slot.atoms.copy() if atoms is None else atoms
    if results is not None and all(np.isfinite(v).all() for v in results.values()):
        atoms.calc = SinglePointCalculator(atoms, **results)
    atoms.info.update(
        index=slot.index, converged=False, steps=slot.steps, failure=reason
    )
    return atoms


def calculator_for(model: Any, device: Any, dtype: Any) -> NVAlchemiCalculator:
    from nvalchemi_ase.calculator import NVAlchemiCalculator

    if isinstance(model, NVAlchemiCalculator):
        if device is not None or dtype is not None:
            raise TypeError(
                "device/dtype come from the calculator; pass a model name to set them"
            )
        return model
    return NVAlchemiCalculator(model, device=device, dtype=dtype)


def checked_properties(
    properties: Iterable[str],
    calc: NVAlchemiCalculator,
    allowed: Iterable[str] | None = PROPERTIES,
) -> list[str]:
    """Return the properties asked for, checked against ``allowed`` and the model."""
    wanted = list(dict.fromkeys(properties))
    unknown = [] if allowed is None else sorted(set(wanted) - set(allowed))
    if unknown:
        raise ValueError(
            f"properties must be among {', '.join(PROPERTIES)}, got {unknown}"
        )
    missing = sorted(set(wanted) - set(calc.implemented_properties))
    if missing:
        raise ValueError(
            f"{type(calc.model).__name__} does not compute {missing}; it "
            f"provides {calc.implemented_properties}"
        )
    return wanted


@contextlib.contextmanager
def quiet_failures() -> Iterator[None]:
    """Failures are reported per structure in the results, not warned about."""
    from nvalchemi_ase.dynamics.failures import StructureFailedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructureFailedWarning)
        yield


@contextlib.contextmanager
def naming_inputs(indices: list[int]) -> Iterator[None]:
    """Give an error of the working batch ``input_indices`` (see module docstring)."""
    try:
        yield
    except Exception as error:
        if not hasattr(error, "input_indices"):
            with contextlib.suppress(AttributeError, TypeError):
                error.input_indices = tuple(indices)  # type: ignore[attr-defined]
        raise


def progress_bar(
    progress: bool | None, what: str, structures: Iterable[Atoms], run: Run
) -> Any:
    """Return a bar over this rank's structures to do (rank 0 only), or None."""
    from nvalchemi_ase.dynamics.progress import ProgressBar, progress_enabled

    if not progress_enabled(progress) or not run.shard.is_root:
        return None
    total = NO_LIMIT
    if isinstance(structures, CountedInputs):
        structures = structures.source
    if isinstance(structures, Sized):
        done = sum(1 for index in run.sink.done if run.shard.owns(index))
        total = run.shard.owned_count(len(structures)) - done
    return ProgressBar(what, total, unit="structure")
