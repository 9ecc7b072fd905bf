"""Relax many reaction paths at once: :func:`relax_paths` and :class:`PathResult`.

Bands of different lengths and sizes (vacancy hops in several cells, adatom
hops on several surfaces, ...) run in one batch on nvalchemi's NEB engine
(:mod:`nvalchemi_ase.mep.engine`), each path converging on its own. Why
nvalchemi's engine: it already keeps many paths in one batch with per-path
convergence, climbing image and fixed atoms, on the device without host
synchronisation, and its NEB forces are ASE's ``improvedtangent`` forces (they
agree to 1e-16 eV/Å on the same band, climbing image and fixed atoms
included). What it lacks is added around it (failure isolation per path, the
skin-aware neighbour list, convergence steps, one cell per path for molecules
and slabs); what it lacks and is not added: ASE's other NEB methods
(``aseneb``, ``eb``, ``spline``, ``string``: use :class:`nvalchemi_ase.mep.NEB`
with an ASE optimizer for those) and ASE's optimizers (the engine runs a
group-aware FIRE2, given ``ase.optimize.FIRE``'s default parameters, see
:data:`~nvalchemi_ase.mep.engine.ASE_FIRE_PARAMETERS`, so a path differs from
ASE's ``FIRE(neb)`` step by step but takes about as many steps, while converged
barriers agree to the accuracy ``fmax`` allows: within 6e-4 eV at fmax 0.01 eV/Å
on the LJ argon paths of the tests, 26-27 steps against ASE's 27-30).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from ase import Atoms
from ase.mep import interpolate as ase_interpolate

from nvalchemi_ase.calculator import NVAlchemiCalculator
from nvalchemi_ase.dynamics.failures import FailureLimits
from nvalchemi_ase.mep.engine import relax_idpp, run_neb

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.devices import DtypeLike
    from nvalchemi_ase.runners.budget import Budget

__all__ = ["INTERPOLATIONS", "PathResult", "relax_paths"]

#: Values of ``relax_paths(interpolate=...)``.
INTERPOLATIONS = ("idpp", "linear", None)
_METHODS = ("improvedtangent",)


@dataclass(frozen=True)
class PathResult:
    """One relaxed path.

    Attributes
    ----------
    images : list of ase.Atoms
        The band, endpoints included, each image holding its own energy (eV)
        and forces (eV/Å) in an ``NVAlchemiCalculator`` (no model call to read
        them; ``ase.mep.NEBTools(result.images)`` works on it).
    energies : numpy.ndarray
        Potential energy of each image, shape (n_images,), eV.
    barrier_forward : float
        Highest image energy minus the initial one, eV (from the images, no
        fit; ``NEBTools.get_barrier()`` gives the fitted value).
    barrier_reverse : float
        Highest image energy minus the final one, eV.
    highest_image : int
        Index of the highest-energy image.
    converged : bool
        Whether the largest NEB force reached ``fmax``.
    steps : int
        Optimizer steps the path took (until it converged or stopped).
    fmax : float
        Largest NEB force norm at the end, eV/Å (NaN for a failed path).
    failure : str or None
        Why the path stopped, for a failed path; None otherwise.
    """

    images: list[Atoms]
    energies: npt.NDArray[np.float64]
    barrier_forward: float
    barrier_reverse: float
    highest_image: int
    converged: bool
    steps: int
    fmax: float
    failure: str | None = None

    @property
    def failed(self) -> bool:
        """Whether an image of this path failed (non-finite or exploding)."""
        return self.failure is not None

    @property
    def reaction_energy(self) -> float:
        """Final minus initial energy, eV."""
        return float(self.energies[-1] - self.energies[0])


def relax_paths(
    paths: Sequence[Sequence[Atoms]],
    model: BaseModelMixin | NVAlchemiCalculator | str,
    *,
    fmax: float = 0.05,
    steps: int = 1000,
    climb: bool = True,
    method: str = "improvedtangent",
    k: float = 0.1,
    interpolate: str | None = "idpp",
    n_images: int | Sequence[int] | None = None,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    failure_limits: FailureLimits | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    max_atoms: int | None = None,
    max_edges: int | None = None,
) -> list[PathResult]:
    """Relax P nudged elastic bands in one batch, each converging on its own.

    The bands are batched whole, as many at a time as the runners' memory
    budget holds (:class:`~nvalchemi_ase.runners.Budget`: the model's memory
    estimate within the free memory of the device, or ``max_atoms`` /
    ``max_edges``); a band larger than the budget runs alone. Each path's
    numbers do not depend on which others share its batch.

    Parameters
    ----------
    paths : sequence of sequences of ase.Atoms
        P paths, never modified. Each is ``[initial, final]`` or a whole band
        ``[initial, ..., final]``; images of one path have the same atoms in
        the same order, pbc and cell. Sizes and lengths may differ between
        paths. ``FixAtoms`` on a path's images hold those atoms fixed.
    model : BaseModelMixin or NVAlchemiCalculator or str
        An nvalchemi model, a calculator over one (its model, device and dtype
        are used) or a name for :func:`~nvalchemi_ase.models.load_model`
        (``"lj"``, ``"sevennet-0"``).
    fmax : float
        Convergence threshold per path on the largest NEB force norm, eV/Å.
    steps : int
        Step limit for the batch (paths that converge stop earlier).
    climb : bool
        Climbing image from the start, re-chosen as the highest image at every
        evaluation (ASE's ``climb=True``).
    method : str
        NEB method; ``"improvedtangent"`` (the engine's).
    k : float
        Spring constant, eV/Å².
    interpolate : {"idpp", "linear", None}
        How interior images are made from each path's two endpoints: linear
        (minimum image) or linear then IDPP (ASE's ``interpolate("idpp")``,
        batched); None keeps the given images (every path a whole band).
    n_images : int or sequence of int, optional
        Images per path, endpoints included (one number, or one per path).
        Default: each path's own length; required for ``[initial, final]``
        pairs.
    device : torch.device or str, optional
        Default: the calculator's, else CUDA when available.
    dtype : torch.dtype or str, optional
        Default: the calculator's, else the model's (float64 for LJ).
    failure_limits : FailureLimits, optional
        When an image counts as exploded; a path with such an image stops and
        is reported failed while the others go on.
    optimizer_kwargs : dict, optional
        Options of the engine's FIRE2 (e.g. ``{"maxstep": 0.05}``, Å), over
        ASE's ``FIRE`` defaults (``dt`` 0.1, ``tmax`` 1.0, ``maxstep`` 0.2 Å,
        ...: :data:`~nvalchemi_ase.mep.engine.ASE_FIRE_PARAMETERS`); nvalchemi's
        NEB tuning is ``{"dt": 0.04, "tmax": 0.055, "maxstep": 0.1,
        "delaystep": 20, "alpha0": 0.25}``.
    max_atoms, max_edges : int, optional
        Batch limits (atoms of all images; ordered pairs within the model's
        cutoff). Default: the model's memory estimate within the free memory.

    Returns
    -------
    list of PathResult
        One per path, in input order.

    Raises
    ------
    ValueError
        For an unsupported method or interpolation, inconsistent images in a
        path, or a pair without ``n_images``.

    Examples
    --------
    >>> from nvalchemi_ase.mep import relax_paths
    >>> results = relax_paths([[a0, a1], [b0, b1]], "lj", n_images=7)  # doctest: +SKIP
    >>> [r.barrier_forward for r in results]  # eV  # doctest: +SKIP
    """
    _check_options(method, interpolate, fmax, steps)
    calc = _calculator(model, device, dtype)
    from nvalchemi_ase.runners.budget import Budget

    budget = Budget.for_calculator(calc, max_atoms, max_edges)  # checked first
    _check_structures(paths, calc)  # the calculator's checks, before any sizing
    bands = _bands(paths, n_images, interpolate)
    if interpolate == "idpp":
        relax_idpp(bands, k=k, device=calc.device, dtype=calc.dtype)
    results: list[PathResult] = []
    for group in _batches(bands, budget):
        outcome = run_neb(
            group,
            calc.model,
            device=calc.device,
            dtype=calc.dtype,
            k=k,
            climb=climb,
            fmax=fmax,
            steps=steps,
            failure_limits=failure_limits,
            optimizer_kwargs=optimizer_kwargs,
        )
        flat = [image for band in group for image in band]
        for image, positions in zip(flat, outcome.positions, strict=True):
            image.set_positions(positions, apply_constraint=False)
        results += _results(group, calc, outcome)
    return results


def _batches(bands: list[list[Atoms]], budget: Budget) -> Iterator[list[list[Atoms]]]:
    """Consecutive groups of whole bands within ``budget`` (input order kept)."""
    group: list[list[Atoms]] = []
    used = np.zeros(4)
    for band in bands:
        cost = sum((budget.cost(image) for image in band), np.zeros(4))
        cost[3] = 1.0  # one structure of the budget's count per band
        if group and not budget.fits(used, cost):
            yield group
            group, used = [], np.zeros(4)
        group.append(band)
        used = used + cost
    if group:
        yield group


# -- inputs -----------------------------------------------------------------------


def _check_options(
    method: str, interpolate: str | None, fmax: float, steps: int
) -> None:
    if method not in _METHODS:
        raise ValueError(
            f"method={method!r}: relax_paths runs nvalchemi's NEB engine, which has "
            f"{_METHODS}; for ASE's other methods use nvalchemi_ase.mep.NEB with an "
            "ASE optimizer"
        )
    if interpolate not in INTERPOLATIONS:
        raise ValueError(
            f"interpolate={interpolate!r}: use one of {INTERPOLATIONS} (None keeps "
            "the given images)"
        )
    if not fmax > 0:
        raise ValueError(f"fmax must be positive (eV/Å), got {fmax}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def _calculator(
    model: BaseModelMixin | NVAlchemiCalculator | str,
    device: torch.device | str | None,
    dtype: DtypeLike,
) -> NVAlchemiCalculator:
    """Return the calculator whose model, device and dtype the run uses."""
    if isinstance(model, NVAlchemiCalculator):
        if device is None and dtype is None:
            return model
        return NVAlchemiCalculator(
            model.model,
            device=device if device is not None else model.device,
            dtype=dtype if dtype is not None else model.dtype,
        )
    return NVAlchemiCalculator(model, device=device, dtype=dtype)


def _bands(
    paths: Sequence[Sequence[Atoms]],
    n_images: int | Sequence[int] | None,
    interpolate: str | None,
) -> list[list[Atoms]]:
    """Fresh bands (copies), interpolated when asked."""
    if isinstance(paths, Atoms) or not len(paths):
        raise ValueError("paths must be a non-empty list of paths (lists of Atoms)")
    counts = _image_counts(paths, n_images, interpolate)
    bands = []
    for index, (path, count) in enumerate(zip(paths, counts, strict=True)):
        _check_path(index, path)
        if interpolate is None:
            band = [image.copy() for image in path]
        else:
            initial, final = path[0], path[-1]
            band = [initial.copy() for _ in range(count - 1)] + [final.copy()]
            ase_interpolate(band, mic=True, apply_constraint=False)
        bands.append(band)
    return bands


def _image_counts(
    paths: Sequence[Sequence[Atoms]],
    n_images: int | Sequence[int] | None,
    interpolate: str | None,
) -> list[int]:
    if n_images is None:
        counts = [len(path) for path in paths]
    elif isinstance(n_images, int | np.integer):
        counts = [int(n_images)] * len(paths)
    else:
        counts = [int(n) for n in n_images]
        if len(counts) != len(paths):
            raise ValueError(
                f"n_images has {len(counts)} entries for {len(paths)} paths"
            )
    for index, (path, count) in enumerate(zip(paths, counts, strict=True)):
        if count < 3:
            given = "n_images" if n_images is not None else f"path {index}"
            raise ValueError(
                f"path {index}: {count} images ({given}); a band needs at least 3 "
                "(initial, one interior image, final): pass n_images=..."
            )
        if interpolate is None and count != len(path):
            raise ValueError(
                f"path {index} has {len(path)} images but n_images={count}; with "
                "interpolate=None the given images are used as they are"
            )
    return counts


def _check_structures(
    paths: Sequence[Sequence[Atoms]], calc: NVAlchemiCalculator
) -> None:
    """Run the calculator's geometry and element checks on every given image.

    Raises
    ------
    StructureError
        For the first image the model cannot run; the message names it as
        ``paths[p][i]`` with the field and the fix.
    """
    from nvalchemi_ase.convert import StructureError, check_images
    from nvalchemi_ase.dynamics.base import DEFAULT_SKIN

    if isinstance(paths, Atoms):
        return  # _bands refuses it with its own message
    for index, path in enumerate(paths):
        if not path or not all(isinstance(image, Atoms) for image in path):
            continue  # _check_path names what is wrong
        try:
            check_images(list(path), model=calc.model, skin=DEFAULT_SKIN)
        except StructureError as error:
            error.args = (f"paths[{index}]" + str(error).removeprefix("images"),)
            error.index = index
            raise


def _check_path(index: int, path: Sequence[Atoms]) -> None:
    """Check for the same atoms, order, pbc and periodic cell in every image."""
    if len(path) < 2 or not all(isinstance(image, Atoms) for image in path):
        raise ValueError(f"path {index}: give at least two Atoms (initial, final)")
    first = path[0]
    for position, image in enumerate(path[1:], start=1):
        if len(image) != len(first) or not np.array_equal(image.numbers, first.numbers):
            raise ValueError(
                f"path {index}, image {position}: atoms differ from the initial "
                "image's (same elements in the same order are needed)"
            )
        if not np.array_equal(image.pbc, first.pbc):
            raise ValueError(f"path {index}, image {position}: pbc differs")
        periodic = first.pbc
        if not np.allclose(image.cell[periodic], first.cell[periodic], atol=1e-8):
            raise ValueError(
                f"path {index}, image {position}: the cell differs from the initial "
                "image's (NEB needs one cell per path)"
            )


# -- results ------------------------------------------------------------------------


def _results(
    bands: list[list[Atoms]], calc: NVAlchemiCalculator, outcome: Any
) -> list[PathResult]:
    """Store the final images' results (one model call on the engine's batch)."""
    results = iter(outcome.results)
    out = []
    for path, band in enumerate(bands):
        failure = outcome.failures.get(path)
        for image in band:
            result = next(results)
            image.calc = calc
            if failure is None:
                calc.store_results(image, result)
        out.append(_path_result(path, band, outcome, failure))
    return out


def _path_result(
    path: int, band: list[Atoms], outcome: Any, failure: Any
) -> PathResult:
    if failure is None:
        energies = np.array([image.get_potential_energy() for image in band])
        highest = int(np.argmax(energies))
        forward = float(energies[highest] - energies[0])
        reverse = float(energies[highest] - energies[-1])
        fmax = float(outcome.fmax[path])
    else:
        energies = np.full(len(band), np.nan)
        highest, forward, reverse, fmax = -1, np.nan, np.nan, np.nan
    return PathResult(
        images=band,
        energies=energies,
        barrier_forward=forward,
        barrier_reverse=reverse,
        highest_image=highest,
        converged=bool(outcome.converged[path]),
        steps=int(outcome.steps[path]),
        fmax=fmax,
        failure=None if failure is None else str(failure),
    )
