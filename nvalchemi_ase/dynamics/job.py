"""The job identity of a dynamics object's checkpoints (``restart=``).

A checkpoint stores the digests (:mod:`nvalchemi_ase.identity`) of the
structures the run *started from* (``structures/identity``, (B, F) uint64,
carried unchanged from checkpoint to checkpoint) and of the model
(``meta["job_model"]``). An object continuing from it must be given the same
structures (or, as after a run in the same process, the structures in the
very state the checkpoint holds) and the same model; anything else is refused
naming the structure and field. The runners' relaxation rebuilds its
optimizer from moved structures and keeps its inputs' identity itself
(:func:`~nvalchemi_ase.identity.inputs_checked_by_caller`); the model is
still checked here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.identity import (
    MD_FIELDS,
    differing_fields,
    inputs_checked_here,
    model_difference,
    model_digest,
    structure_digests,
)

if TYPE_CHECKING:
    from ase import Atoms

__all__ = ["IDENTITY_ARRAY", "MODEL_KEY", "job_entries", "job_mismatch", "start_job"]

#: Checkpoint array of the starting structures' digests, (B, len(MD_FIELDS)).
IDENTITY_ARRAY = "structures/identity"
#: Checkpoint metadata key of the model digest.
MODEL_KEY = "job_model"


def start_job(
    images: list[Atoms], saved: npt.NDArray[np.uint64] | None
) -> npt.NDArray[np.uint64] | None:
    """Return the identity a run's checkpoints carry: ``saved`` when continuing.

    Without ``saved`` (a new run, or a checkpoint that predates identities)
    the digests of ``images`` as given; inside
    :func:`~nvalchemi_ase.identity.inputs_checked_by_caller`, None.
    """
    if not inputs_checked_here():
        return None
    if saved is not None:
        return saved
    return structure_digests(images, MD_FIELDS)


def job_entries(
    model: Any, dtype: Any, inputs: npt.NDArray[np.uint64] | None
) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """Return the checkpoint metadata and arrays of a run's identity."""
    meta = {MODEL_KEY: model_digest(model, dtype)}
    arrays = {} if inputs is None else {IDENTITY_ARRAY: inputs}
    return meta, arrays


def job_mismatch(
    images: list[Atoms],
    model: Any,
    dtype: Any,
    meta: dict[str, Any],
    arrays: dict[str, npt.NDArray[Any]],
) -> str | None:
    """Why a checkpoint belongs to another job (None: the same job).

    Checks the model (when the file names one) and, unless the caller checks
    them, each structure: the one given must be the one the run started
    from, or be in the very state the checkpoint holds.
    """
    saved_model = meta.get(MODEL_KEY)
    if saved_model is not None:
        current = model_digest(model, dtype)
        if saved_model != current:
            return (
                f"field 'model' ({model_difference(saved_model, current)}) is "
                f"{saved_model!r} in the checkpoint but {current!r} here (another "
                "model, its parameters or weights)"
            )
    saved = arrays.get(IDENTITY_ARRAY)
    if saved is None or not inputs_checked_here():
        return None
    current_rows = structure_digests(images, MD_FIELDS)
    if saved.shape != current_rows.shape:
        return f"field 'identity' has shape {saved.shape} but {current_rows.shape} here"
    differs = np.flatnonzero((saved != current_rows).any(axis=1))
    for index in differs:
        if _in_checkpoint_state(images, int(index), arrays):
            continue
        fields = differing_fields(saved[index], current_rows[index], MD_FIELDS)
        return (
            f"images[{index}] is not the structure the run started from (it differs "
            f"in {', '.join(repr(f) for f in fields)})"
        )
    return None


def _in_checkpoint_state(
    images: list[Atoms], index: int, arrays: dict[str, npt.NDArray[Any]]
) -> bool:
    """Whether ``images[index]`` holds the checkpoint's positions and cell exactly."""
    positions, cells = arrays.get("batch/positions"), arrays.get("batch/cell")
    if positions is None or cells is None or index >= len(cells):
        return False
    sizes = np.array([len(atoms) for atoms in images])
    start = int(sizes[:index].sum())
    atoms = images[index]
    saved = positions[start : start + len(atoms)]
    return bool(
        saved.shape == atoms.positions.shape
        and np.array_equal(atoms.positions.astype(saved.dtype), saved)
        and np.array_equal(atoms.cell.array.astype(cells.dtype), cells[index])
    )
