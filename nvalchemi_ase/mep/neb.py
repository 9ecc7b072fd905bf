"""ASE's ``NEB`` with every image of a force evaluation in one model call.

:class:`NEB` is ``ase.mep.NEB`` itself, subclassed at one seam: before ASE's
``get_forces`` runs, the images whose energy and forces it is about to ask for
and that are not cached are evaluated together by
:meth:`~nvalchemi_ase.calculator.NVAlchemiCalculator.calculate_batch` and the
results are stored in each image's own calculator. ASE's code then finds every
result cached (``image.get_forces()`` makes no model call) and computes
tangents, springs, the climbing image and the residual exactly as it always
does; optimizers, ``NEBTools``, ``interpolate()`` and trajectories see ASE's
object.

Which images: the interior ones; the two endpoints too for methods that read
their energies (all but ``"aseneb"``), the first time (afterwards they are
cached), when they carry an ``NVAlchemiCalculator`` over the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from ase import Atoms
from ase.build import minimize_rotation_and_translation
from ase.mep import NEB as ASENEB

from nvalchemi_ase.calculator import NVAlchemiCalculator

__all__ = ["NEB", "batch_evaluator"]

_PROPERTIES = ("energy", "forces")


class NEB(ASENEB):
    """ASE's nudged elastic band, evaluating its images in one batched model call.

    The arguments, attributes and behaviour are those of ``ase.mep.NEB``
    (ASE 3.29); only how image energies and forces are obtained differs. Use
    it wherever ASE's is used: ``FIRE(neb)``, ``BFGS(neb)``, ``NEBTools``,
    ``neb.interpolate()`` / ``neb.interpolate("idpp")``, ``Trajectory`` of
    the band.

    Parameters
    ----------
    images : list of ase.Atoms
        The band, endpoints included (same atoms, order and cell in each).
    k : float or list of float
        Spring constant(s), eV/Å² (force per unit stretch; ASE writes eV/Å).
    climb : bool
        Climbing image (ASE's: the highest image, re-chosen every evaluation).
    parallel : bool
        ASE's option; with one process it runs one thread per image, which
        here only reads results already computed. Needs
        ``allow_shared_calculator=False`` (ASE's rule).
    remove_rotation_and_translation : bool
        NEB-TR, applied before each evaluation as in ASE.
    world : ase.parallel world, optional
        ASE's MPI communicator.
    method : str, optional
        ``"aseneb"``, ``"improvedtangent"``, ``"eb"``, ``"spline"``,
        ``"string"``; None gives ASE's default (``"improvedtangent"``, with
        ASE's warning).
    allow_shared_calculator : bool
        Default True (ASE: False): one ``NVAlchemiCalculator`` on every image
        is the usual set-up here; it gives each image its own result view.
    precon : optional
        ASE's preconditioner (``"spline"``/``"string"`` only).
    **kwargs
        ASE's deprecated dynamic-relaxation keywords.

    Notes
    -----
    Batched evaluation needs the interior images to carry
    ``NVAlchemiCalculator`` objects over one model (one calculator, or
    several sharing the model, device and dtype). Otherwise — another
    calculator, as during ``interpolate("idpp")``, or several models — ASE
    evaluates the images one at a time, as ``ase.mep.NEB`` would.

    After each evaluation every image holds its own results
    (``image.calc.results``, ``image.get_potential_energy()``), so ``NEBTools``
    and trajectories read each image's own numbers.

    Examples
    --------
    >>> from ase.optimize import FIRE
    >>> neb = NEB(images, climb=True, method="improvedtangent")  # doctest: +SKIP
    >>> neb.interpolate("idpp")  # doctest: +SKIP
    >>> FIRE(neb).run(fmax=0.05)  # one model call per step  # doctest: +SKIP
    """

    def __init__(
        self,
        images: Sequence[Atoms],
        k: float | Sequence[float] = 0.1,
        climb: bool = False,
        parallel: bool = False,
        remove_rotation_and_translation: bool = False,
        world: Any = None,
        method: str | None = None,
        allow_shared_calculator: bool = True,
        precon: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            images,
            k=k,
            climb=climb,
            parallel=parallel,
            remove_rotation_and_translation=remove_rotation_and_translation,
            world=world,
            method=method,
            allow_shared_calculator=allow_shared_calculator,
            precon=precon,
            **kwargs,
        )

    def get_forces(self) -> npt.NDArray[np.float64]:
        """NEB forces of the interior images, shape ((nimages - 2) * natoms, 3), eV/Å.

        The images ASE is about to read are evaluated first, in one model
        call; then ASE's ``get_forces`` runs unchanged on cached results.

        Returns
        -------
        numpy.ndarray
            As ``ase.mep.NEB.get_forces``.
        """
        if self.remove_rotation_and_translation:
            for i in range(1, self.nimages):
                minimize_rotation_and_translation(self.images[i - 1], self.images[i])
        self.evaluate_images()
        with self._alignment_done():
            return super().get_forces()

    def evaluate_images(self) -> int:
        """Evaluate, in one model call, the images whose results are not cached.

        Returns
        -------
        int
            How many images were evaluated (0: all cached, or the images do
            not share one nvalchemi model, in which case ASE evaluates them).
        """
        evaluator = batch_evaluator(self.images[1:-1])
        if evaluator is None:
            return 0
        wanted = list(range(1, self.nimages - 1))
        if self.method != "aseneb":  # ASE reads the endpoint energies too
            wanted = [0, *wanted, self.nimages - 1]
        stale = [
            self.images[i]
            for i in wanted
            if _same_model(self.images[i].calc, evaluator)
            and not _holds_results(self.images[i])
        ]
        if not stale:
            return 0
        results = evaluator.calculate_batch(stale, _PROPERTIES)
        for image, result in zip(stale, results, strict=True):
            image.calc.store_results(image, result)
        return len(stale)

    @contextlib.contextmanager
    def _alignment_done(self) -> Iterator[None]:
        """ASE's ``get_forces`` without its own NEB-TR pass (done before evaluating)."""
        saved = self.remove_rotation_and_translation
        self.remove_rotation_and_translation = False
        try:
            yield
        finally:
            self.remove_rotation_and_translation = saved


def batch_evaluator(images: Sequence[Atoms]) -> NVAlchemiCalculator | None:
    """Return a calculator able to evaluate ``images`` in one call, or None.

    Parameters
    ----------
    images : sequence of ase.Atoms
        Structures, each expected to carry an ``NVAlchemiCalculator``.

    Returns
    -------
    NVAlchemiCalculator or None
        The first image's calculator when every image carries one over the same
        model object, device and dtype; None otherwise (or for no images).
    """
    if not images:
        return None
    first = images[0].calc
    if not isinstance(first, NVAlchemiCalculator):
        return None
    if all(_same_model(image.calc, first) for image in images):
        return first
    return None


def _same_model(calc: Any, reference: NVAlchemiCalculator) -> bool:
    return (
        isinstance(calc, NVAlchemiCalculator)
        and calc.model is reference.model
        and calc.device == reference.device
        and calc.dtype == reference.dtype
    )


def _holds_results(image: Atoms) -> bool:
    """Whether ``image``'s calculator holds its energy and forces.

    No side effects beyond those of ``get_property`` (a shared calculator hands
    ``image`` its own view).
    """
    calc = image.calc
    return all(
        calc.get_property(name, image, allow_calculation=False) is not None
        for name in _PROPERTIES
    )
