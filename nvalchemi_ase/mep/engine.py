"""Many bands in one batch on nvalchemi's NEB engine, each path on its own.

Every image is one graph of an nvalchemi ``Batch`` and the batch's group layout
says which images form a path, so bands of different lengths and sizes relax
together: one model call per step for every image of every path (the fixed
endpoints only at the first), and
``nvalchemi.dynamics.mep.NEB`` (its NEB forces, climbing image, group-aware
FIRE2 and per-path convergence) does the rest. This module adds what the
engine leaves to its caller:

* the neighbour list is this package's eager, skin-aware hook
  (:func:`~nvalchemi_ase.dynamics.neighbors.neighbor_hooks`);
* failure isolation per path and the step each path converged at
  (:class:`~nvalchemi_ase.mep.monitor.PathMonitor`);
* no model work on images that no longer move: each band's fixed endpoints
  after the first evaluation and, on a CPU, the images of converged paths
  (:class:`~nvalchemi_ase.mep.settled.SettledImages`, which also keeps the
  final results, so none are evaluated again after the run);
* fixed atoms: ``FixAtoms`` of a path's images become the engine's
  ``fixed_atom_indices`` for that path;
* one cell per path where ASE leaves a cell vector zero (:func:`path_batch`);
* batched IDPP interpolation on the same engine (:func:`relax_idpp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms
from ase.constraints import FixAtoms

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import atoms_to_batch, batch_field
from nvalchemi_ase.dynamics.base import DEFAULT_SKIN
from nvalchemi_ase.dynamics.failures import FailureLimits
from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
from nvalchemi_ase.mep.monitor import EngineOutcome, PathMonitor, split_positions
from nvalchemi_ase.mep.settled import SettledImages
from nvalchemi_ase.models.locks import model_lock

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "fixed_atoms",
    "path_batch",
    "relax_idpp",
    "run_neb",
]

#: ASE's ``idpp_interpolate`` defaults: force threshold (eV/Å) and step limit.
IDPP_FMAX, IDPP_STEPS = 0.1, 100

#: The engine's FIRE2 parameters by default: ``ase.optimize.FIRE``'s defaults under
#: FIRE2's names (``dt``, ``dtmax`` -> ``tmax``, ``maxstep``, ``Nmin`` ->
#: ``delaystep``, ``finc`` -> ``dtgrow``, ``fdec`` -> ``dtshrink``, ``astart`` ->
#: ``alpha0``, ``fa`` -> ``alphashrink``; both are mass-free, so ``dt`` means the
#: same). nvalchemi's NEB tuning (``dt`` 0.04, ``tmax`` 0.055, ``maxstep`` 0.1,
#: ``delaystep`` 20, ...) takes about 2.6 times ASE's steps on the LJ paths of
#: ``benchmarks/neb.py`` (31 against 12); these take 11, barriers as close to ASE's.
#: ``tmin`` stays nvalchemi's NEB value (ASE's FIRE has no lower bound).
ASE_FIRE_PARAMETERS = {
    "dt": 0.1,
    "tmax": 1.0,
    "maxstep": 0.2,
    "delaystep": 5,
    "dtgrow": 1.1,
    "dtshrink": 0.5,
    "alpha0": 0.1,
    "alphashrink": 0.99,
}


def path_batch(
    bands: Sequence[Sequence[Atoms]], device: torch.device, dtype: torch.dtype
) -> Batch:
    """One ``Batch`` of every image of every band, grouped by path.

    Parameters
    ----------
    bands : sequence of sequences of ase.Atoms
        P bands, each its images in order (endpoints included).
    device : torch.device
        Where the batch lives.
    dtype : torch.dtype
        Precision of positions and cell.

    Returns
    -------
    nvalchemi.data.Batch
        Graph ``j`` of path ``p`` is ``bands[p][j]``; ``group_idx`` [B] holds
        the path of each graph.

    Notes
    -----
    A cell vector ASE leaves zero on a non-periodic axis (molecules, slabs
    without a third vector) gets a stand-in spanning the structure in the
    batch (see :mod:`nvalchemi_ase.convert`), so images of one path would get
    different stand-ins where their extents differ, and nvalchemi's NEB
    refuses paths whose images have different cells. Every image of a path
    gets the longest of its path's stand-ins instead (no periodic image is
    generated along it either way).
    """
    flat = [image for band in bands for image in band]
    batch = atoms_to_batch(flat, device=device, dtype=dtype, warn_dropped=False)
    counts = [len(band) for band in bands]
    paths = torch.arange(len(bands), device=batch.device)
    group = torch.repeat_interleave(paths, torch.as_tensor(counts, device=paths.device))
    batch.set_group_layout(group)
    _share_stand_in_cells(batch, counts)
    return batch


def _share_stand_in_cells(batch: Batch, counts: Sequence[int]) -> None:
    """Give every image of a path the same stand-in cell vectors (Å)."""
    padding = batch_field(batch, "cell_padding")
    if padding is None or not bool(padding.any()):
        return
    with torch.no_grad():
        cells = batch.cell.detach().reshape(-1, 3, 3)
        flags = padding.reshape(-1, 3).bool()
        start = 0
        for count in counts:
            block = slice(start, start + count)
            longest = cells[block].norm(dim=-1).argmax(dim=0)  # [3] image per axis
            shared = cells[block][longest, torch.arange(3, device=cells.device)]
            cells[block] = torch.where(flags[block, :, None], shared, cells[block])
            start += count


def fixed_atoms(bands: Sequence[Sequence[Atoms]]) -> dict[int, tuple[int, ...]]:
    """Atoms held fixed per path: the union of ``FixAtoms`` over its images.

    Parameters
    ----------
    bands : sequence of sequences of ase.Atoms
        The bands.

    Returns
    -------
    dict of int to tuple of int
        Path index to sorted atom indices; paths without fixed atoms are absent.
    """
    fixed: dict[int, tuple[int, ...]] = {}
    for path, band in enumerate(bands):
        indices: set[int] = set()
        for image in band:
            for constraint in image.constraints:
                if isinstance(constraint, FixAtoms):
                    indices.update(int(i) for i in constraint.get_indices())
        if indices:
            fixed[path] = tuple(sorted(indices))
    return fixed


def relax_idpp(
    bands: Sequence[Sequence[Atoms]],
    *,
    k: float,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Move the interior images of every band to IDPP's path, all bands at once.

    The batched counterpart of ``ase.mep.idpp_interpolate``: NEB on the
    image-dependent pair potential (nvalchemi's ``IDPPModel``, minimum-image
    pair distances), from the bands' current (linearly interpolated) images,
    to IDPP's force threshold of 0.1 eV/Å or 100 steps, as ASE's defaults.

    Parameters
    ----------
    bands : sequence of sequences of ase.Atoms
        Bands whose interior positions are replaced in place (Å).
    k : float
        Spring constant, eV/Å².
    device : torch.device
        Where to run.
    dtype : torch.dtype
        Precision.
    """
    mep = import_quietly("nvalchemi.dynamics.mep")
    batch = path_batch(bands, device, dtype)
    mep.prepare_idpp_targets(batch)
    strategy = mep.NEB(
        model=mep.IDPPModel(),
        spring=k,
        fmax=IDPP_FMAX,
        n_steps=IDPP_STEPS,
        neighbor_hooks=[],
        fixed_atom_indices=fixed_atoms(bands) or None,
    )
    strategy.build_engine().run(batch, n_steps=IDPP_STEPS)
    _write_positions(bands, split_positions(batch), interior_only=True)


def run_neb(
    bands: Sequence[Sequence[Atoms]],
    model: BaseModelMixin,
    *,
    device: torch.device,
    dtype: torch.dtype,
    k: float,
    climb: bool,
    fmax: float,
    steps: int,
    failure_limits: FailureLimits | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
) -> EngineOutcome:
    """Relax every band in one batch on ``nvalchemi.dynamics.mep.NEB``.

    Parameters
    ----------
    bands : sequence of sequences of ase.Atoms
        P bands (3 or more images each; never modified).
    model : BaseModelMixin
        The nvalchemi model, already on ``device`` in ``dtype``.
    device : torch.device
        Where to run.
    dtype : torch.dtype
        Precision.
    k : float
        Spring constant, eV/Å².
    climb : bool
        Climbing image from the first step, re-chosen as the highest image
        after every evaluation (ASE's ``climb=True``).
    fmax : float
        Per-path convergence threshold on the largest NEB force, eV/Å.
    steps : int
        Step limit for the whole batch.
    failure_limits : FailureLimits, optional
        When an image counts as exploded (defaults of ``FailureLimits``).
    optimizer_kwargs : dict, optional
        Passed to the engine's FIRE2, over :data:`ASE_FIRE_PARAMETERS` (ASE's
        ``FIRE`` defaults); nvalchemi's NEB tuning fills the rest (``tmin``).

    Returns
    -------
    EngineOutcome
        Final positions, per-path convergence, steps, fmax and failures.
    """
    mep = import_quietly("nvalchemi.dynamics.mep")
    batch = path_batch(bands, device, dtype)
    monitor = PathMonitor(batch, failure_limits or FailureLimits())
    lists = neighbor_hooks(model, DEFAULT_SKIN)
    settled = SettledImages(batch, lists)
    climbing = (
        mep.ClimbingImageConfig(mode="immediate", selection="dynamic")
        if climb
        else None
    )
    strategy = mep.NEB(
        model=model,
        spring=k,
        method="improved_tangent",
        climbing=climbing,
        fmax=fmax,
        n_steps=steps,
        neighbor_hooks=[*lists, settled],  # settled before the engine's path hooks
        extra_hooks=monitor.hooks(),
        fixed_atom_indices=fixed_atoms(bands) or None,
        optimizer_kwargs={**ASE_FIRE_PARAMETERS, **(optimizer_kwargs or {})},
    )
    engine = strategy.build_engine()
    monitor.bind(engine)
    with model_lock(model), model.narrowed_outputs({"energy", "forces"}):
        engine.run(batch, n_steps=steps)
    return monitor.outcome(batch, engine.step_count, settled.results(batch))


def _write_positions(
    bands: Sequence[Sequence[Atoms]],
    positions: list[npt.NDArray[np.float64]],
    *,
    interior_only: bool,
) -> None:
    """Set every image's positions from the flat per-image list (Å)."""
    flat = iter(positions)
    for band in bands:
        for index, image in enumerate(band):
            new = next(flat)
            if interior_only and index in (0, len(band) - 1):
                continue
            image.set_positions(new, apply_constraint=False)
