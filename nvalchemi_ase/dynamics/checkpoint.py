"""Exact restart: a safe checkpoint of a batched dynamics run (``restart=``).

Every ASE-style class takes ``restart=PATH`` (ASE's argument name and
semantics): if the file exists, the object continues from it; otherwise it
starts from the structures it is given and writes the file every
``restart_interval`` steps (default :data:`DEFAULT_RESTART_INTERVAL`; ASE
writes every step) and at the end of every ``run()``. Continuing from a
checkpoint gives the same numbers, bit for bit, as a run that was never
interrupted (same device, dtype and library versions).

Format
------
One NumPy ``.npz`` archive (a zip of ``.npy`` arrays), read with
``allow_pickle=False``, so loading never unpickles or runs code. Entry
``meta`` is a JSON string; the others are arrays:

================================  ==============================================
entry                             content
================================  ==============================================
``meta``                          format name and version, class and engine
                                  names, ASE step counter ``nsteps``, engine
                                  ``step_count`` and ``random_seed``, number of
                                  structures, atoms per structure, dtype, model
                                  name and outputs, cell filter, the run's
                                  parameters (``todict()``), versions, time
``structures/atomic_numbers``     (V,) every structure's numbers, concatenated
``structures/pbc``                (B, 3)
``structures/identity``           (B, F) uint64: digests of the structures the
                                  run started from (:mod:`~nvalchemi_ase.
                                  dynamics.job`; ``meta["job_model"]`` the
                                  model's), checked on continuing
``batch/<field>``                 positions [V, 3] Å, velocities [V, 3],
                                  cell [B, 3, 3] Å, energy [B, 1] eV, forces
                                  [V, 3] eV/Å, stress [B, 3, 3] eV/Å³, status
                                  [B, 1], as the engine holds them
``engine/<field>``                the engine's per-structure state
                                  (``BaseDynamics.state_dict()``): FIRE's ``dt``
                                  and ``alpha``, L-BFGS history, BFGS Hessians,
                                  thermostat chains, barostat variables, ...
``neighbors/<i>/<field>``         the neighbour list the next steps reuse
                                  (pair order included: the sums are the same)
``failures/<field>``              (B,) failed flags, failure steps and reasons,
                                  reference volumes
``extra/<field>``                 class-specific: cell-filter alignment,
                                  convergence flags, trajectory frame and log
                                  file sizes, FIRE's ``downhill_check``
                                  positions;
                                  the caller's ``checkpoint_tags`` as
                                  ``extra/tag/<name>`` (not compared)
================================  ==============================================

Random numbers: every stochastic engine here (``Langevin``, ``Bussi``,
``Andersen``) draws its noise from ``random_seed`` and ``step_count``, not from
a generator that advances, so those two integers are its whole random state.

A checkpoint is written to a temporary file in the same directory
(``.<name>.<random>.tmp``), flushed to disk and renamed over the previous one
(``os.replace``), so a kill while writing leaves the previous checkpoint
intact (and at worst a stale temporary file, which is never read). A file
that is not such a checkpoint, is damaged, or does not match the structures,
class, model or arguments it is given is refused with a
:class:`CheckpointError` (a ``ValueError`` and ASE's ``RestartError``)
naming the file, the field and the fix, before any step is taken.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase.optimize.optimize import RestartError

from nvalchemi_ase._compat import engine_state
from nvalchemi_ase.dynamics.job import IDENTITY_ARRAY, job_entries, job_mismatch
from nvalchemi_ase.dynamics.neighbors import (
    is_neighbor_hook,
    load_neighbor_state,
    neighbor_state,
)

if TYPE_CHECKING:
    from nvalchemi_ase.dynamics.base import BatchedDynamics

__all__ = [
    "DEFAULT_RESTART_INTERVAL",
    "FORMAT",
    "VERSION",
    "Checkpoint",
    "CheckpointError",
    "capture",
    "check_matches",
    "read_checkpoint",
    "restore_engine",
    "restore_structures",
    "write_checkpoint",
]

#: Format name stored in every checkpoint's metadata.
FORMAT = "nvalchemi_ase.checkpoint"
#: Format version; a reader refuses files from a newer version.
VERSION = 1
#: Steps between checkpoint writes when ``restart_interval`` is not given
#: (ASE writes every step; one write costs a device-to-host copy of the whole
#: state and an fsync, which would dominate a small batched step).
DEFAULT_RESTART_INTERVAL = 100

#: Batch fields the next step depends on (those present are saved).
BATCH_FIELDS = ("positions", "velocities", "cell")
#: Model outputs: restored after the priming evaluation, which recomputes them.
RESULT_FIELDS = ("energy", "forces", "stress")
#: nvalchemi's per-structure ``status`` column, restored after the priming
#: evaluation too: with it, that evaluation would skip frozen structures and
#: leave their outputs unset.
STATUS_FIELD = "status"
#: ``todict()`` entries that may differ between the run and its continuation.
_VOLATILE_PARAMETERS = frozenset({"restart", "fmax", "max_steps", "seed"})
_FIX = (
    "pass the structures and arguments of the run that wrote it, or remove the "
    "file (or give another restart path) to start afresh"
)


class CheckpointError(ValueError, RestartError):
    """A checkpoint file that cannot be used: unreadable, foreign or mismatched.

    A ``ValueError`` and ASE's ``ase.optimize.RestartError``, the error ASE's
    optimizers raise for a restart file they cannot use.
    """


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as read from disk.

    Attributes
    ----------
    path : pathlib.Path
        The file.
    meta : dict
        The JSON metadata (see the module docstring).
    arrays : dict of numpy.ndarray
        Every other entry, by name.
    """

    path: Path
    meta: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]

    @property
    def job_inputs(self) -> npt.NDArray[np.uint64] | None:
        """Digests of the structures the run started from (None: an older file)."""
        return self.arrays.get(IDENTITY_ARRAY)

    def group(self, prefix: str) -> dict[str, npt.NDArray[Any]]:
        """Return the entries under ``prefix/``, keyed by the rest of their name."""
        start = prefix + "/"
        return {
            key[len(start) :]: value
            for key, value in self.arrays.items()
            if key.startswith(start)
        }


# ----------------------------------------------------------------------------
# The file
# ----------------------------------------------------------------------------


def write_checkpoint(
    path: str | os.PathLike[str],
    meta: dict[str, Any],
    arrays: dict[str, npt.NDArray[Any]],
) -> Path:
    """Write a checkpoint atomically: temporary file, fsync, ``os.replace``.

    Parameters
    ----------
    path : str or path
        Destination; its directory must exist.
    meta : dict
        JSON-serialisable metadata; ``format`` and ``version`` are added.
    arrays : dict of numpy.ndarray
        Named arrays (no object arrays).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    path = Path(path)
    text = json.dumps({"format": FORMAT, "version": VERSION, **meta})
    handle, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, meta=np.array(text), **arrays)  # type: ignore[arg-type]
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint without unpickling anything.

    Parameters
    ----------
    path : str or path
        A file written by :func:`write_checkpoint`.

    Returns
    -------
    Checkpoint
        Its metadata and arrays.

    Raises
    ------
    CheckpointError
        If the file is damaged, is not an ``nvalchemi_ase`` checkpoint, or comes
        from a newer format version.
    """
    path = Path(path)
    try:
        with path.open("rb") as stream:
            data = np.load(stream, allow_pickle=False)
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise ValueError("a single .npy array, not an .npz archive")
            with data:
                _check_declared_sizes(path, data)  # hook: before any allocation
                arrays = {key: data[key] for key in data.files}
    except CheckpointError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as error:
        raise CheckpointError(
            f"Could not decode restart file {path}: it cannot be read as an "
            "nvalchemi_ase checkpoint "
            f"({type(error).__name__}: {error}); it may be damaged or written by "
            "another program. Remove it (or give another restart path) to start "
            "afresh"
        ) from error
    text = arrays.pop("meta", None)
    meta: Any = None
    if text is not None and text.dtype.kind == "U" and text.ndim == 0:
        with contextlib.suppress(ValueError):
            meta = json.loads(str(text[()]))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"restart file {path} is not an nvalchemi_ase checkpoint (its 'meta' "
            f"entry does not name the format {FORMAT!r}); remove it or give "
            "another restart path"
        )
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"restart file {path} has format version {version!r}; this "
            f"nvalchemi_ase reads versions up to {VERSION}. Upgrade nvalchemi_ase "
            "or start afresh"
        )
    return Checkpoint(path=path, meta=meta, arrays=arrays)


def _check_declared_sizes(path: Path, data: Any) -> None:
    """Refuse an entry declaring more bytes than the file holds for it.

    Each ``.npy`` header states a shape and dtype; an array is allocated from
    them before its bytes are read, so a damaged or forged header could ask
    for any amount of memory. The zip directory gives every entry's size:
    an array can never be larger.
    """
    from numpy.lib import format as npy

    for key in data.files:
        name = key if key.endswith(".npy") else f"{key}.npy"
        try:
            stored = data.zip.getinfo(name).file_size
        except KeyError:
            continue
        with data.zip.open(name) as entry:
            version = npy.read_magic(entry)
            if version == (1, 0):
                shape, _, dtype = npy.read_array_header_1_0(entry)
            else:
                shape, _, dtype = npy.read_array_header_2_0(entry)
        declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if declared > stored:
            raise CheckpointError(
                f"restart file {path}: field {key!r} declares shape {tuple(shape)} "
                f"({declared:.3g} bytes) but the file holds {stored} bytes for it; "
                "the file is damaged or was not written by nvalchemi_ase. Remove it "
                "(or give another restart path) to start afresh"
            )


# ----------------------------------------------------------------------------
# What a dynamics object is, and whether a checkpoint matches it
# ----------------------------------------------------------------------------


def identity(dyn: BatchedDynamics) -> dict[str, Any]:
    """Describe what a checkpoint must match to continue ``dyn``.

    Parameters
    ----------
    dyn : BatchedDynamics
        The dynamics object.

    Returns
    -------
    dict
        ``class``, ``engine``, ``n_structures``, ``n_atoms``, ``dtype``,
        ``model``, ``model_outputs``, ``cell_filter`` and ``parameters``
        (``todict()`` without entries that may change between runs).
    """
    outputs = dyn.model.model_config.outputs
    return {
        "class": type(dyn).__name__,
        "engine": type(dyn.engine).__name__,
        "n_structures": len(dyn.images),
        "n_atoms": [len(atoms) for atoms in dyn.images],
        "dtype": str(dyn.setup.dtype).removeprefix("torch."),
        "model": type(dyn.model).__name__,
        "model_outputs": sorted(str(getattr(o, "value", o)) for o in outputs),
        "cell_filter": None if dyn.cell_filter is None else dyn.cell_filter.kind,
        "parameters": _parameters(dyn),
    }


def check_matches(dyn: BatchedDynamics, checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint written for other structures, another class or model.

    Parameters
    ----------
    dyn : BatchedDynamics
        The object that would continue from ``checkpoint``.
    checkpoint : Checkpoint
        What :func:`read_checkpoint` returned.

    Raises
    ------
    CheckpointError
        Naming the file, the first field that differs, both values and the fix.
    """
    path, meta = checkpoint.path, checkpoint.meta
    current = identity(dyn)
    for field in ("class", "engine", "n_structures", "n_atoms"):
        _same(path, field, meta.get(field), current[field])
    numbers = np.concatenate([atoms.numbers for atoms in dyn.images])
    saved_numbers = checkpoint.arrays.get("structures/atomic_numbers")
    if saved_numbers is None or not np.array_equal(saved_numbers, numbers):
        index = _first_structure_differing(dyn, saved_numbers)
        raise CheckpointError(
            f"restart file {path}: field 'atomic_numbers' differs for images[{index}] "
            f"(the checkpoint was written for other atoms); {_FIX}"
        )
    pbc = np.stack([atoms.pbc for atoms in dyn.images])
    saved_pbc = checkpoint.arrays.get("structures/pbc")
    if saved_pbc is None or not np.array_equal(saved_pbc, pbc):
        raise CheckpointError(
            f"restart file {path}: field 'pbc' is "
            f"{None if saved_pbc is None else saved_pbc.tolist()} in the checkpoint "
            f"but {pbc.tolist()} here; {_FIX}"
        )
    for field in ("dtype", "model", "model_outputs", "cell_filter", "parameters"):
        _same(path, field, meta.get(field), current[field])
    mismatch = job_mismatch(dyn, meta, checkpoint.arrays)  # hook: job identity
    if mismatch is not None:
        raise CheckpointError(f"restart file {path}: {mismatch}; {_FIX}")


def _same(path: Path, field: str, saved: Any, current: Any) -> None:
    if saved != current:
        raise CheckpointError(
            f"restart file {path}: field {field!r} is {saved!r} in the checkpoint "
            f"but {current!r} here; {_FIX}"
        )


def _first_structure_differing(
    dyn: BatchedDynamics, saved: npt.NDArray[Any] | None
) -> int:
    if saved is None:
        return 0
    start = 0
    for index, atoms in enumerate(dyn.images):
        stop = start + len(atoms)
        if not np.array_equal(saved[start:stop], atoms.numbers):
            return index
        start = stop
    return 0


def _parameters(dyn: BatchedDynamics) -> dict[str, Any]:
    """``dyn.todict()`` as JSON would give it back, without volatile entries."""
    description = {
        key: value
        for key, value in dyn.todict().items()
        if key not in _VOLATILE_PARAMETERS
    }
    result: dict[str, Any] = json.loads(json.dumps(description, default=_jsonable))
    return result


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    return str(value)


# ----------------------------------------------------------------------------
# Capture and restore
# ----------------------------------------------------------------------------


def capture(dyn: BatchedDynamics) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """Everything the next step of ``dyn`` depends on, for :func:`write_checkpoint`.

    Parameters
    ----------
    dyn : BatchedDynamics
        A dynamics object whose engine has been primed (inside or after a run).

    Returns
    -------
    meta : dict
        JSON metadata.
    arrays : dict of numpy.ndarray
        Host copies of the state (see the module docstring).
    """
    batch = dyn.batch
    arrays: dict[str, npt.NDArray[Any]] = {
        "structures/atomic_numbers": np.concatenate(
            [atoms.numbers for atoms in dyn.images]
        ),
        "structures/pbc": np.stack([atoms.pbc for atoms in dyn.images]),
    }
    for key in (*BATCH_FIELDS, STATUS_FIELD, *RESULT_FIELDS):
        if key in batch:
            arrays[f"batch/{key}"] = _host(batch[key])
    engine_state = dyn.engine.state_dict()
    for key, value in engine_state.get("state", {}).items():
        arrays[f"engine/{key}"] = _host(value)
    for key, value in dyn._guard.state().items():
        arrays[f"failures/{key}"] = _host(value)
    for index, hook in enumerate(_neighbor_hooks(dyn)):
        for key, value in neighbor_state(hook).items():
            arrays[f"neighbors/{index}/{key}"] = _host(value)
    for key, value in dyn._checkpoint_extras().items():
        arrays[f"extra/{key}"] = np.asarray(value)
    job_meta, job_arrays = job_entries(dyn)  # hook: job identity
    arrays |= job_arrays
    seed = engine_state.get("random_seed")
    meta = (
        identity(dyn)
        | job_meta
        | {
            "nsteps": int(dyn.nsteps),
            "engine_step_count": int(engine_state.get("step_count", 0)),
            "random_seed": None if seed is None else int(seed),
            "stress_step": int(dyn._stress_step),
            "written": datetime.datetime.now(datetime.UTC).isoformat(
                timespec="seconds"
            ),
            "versions": _versions(),
        }
    )
    return meta, arrays


def restore_structures(dyn: BatchedDynamics, checkpoint: Checkpoint) -> None:
    """Put a checkpoint's structures, counters and flags into a new ``dyn``.

    The engine's own state and the model outputs follow at the first
    evaluation (:func:`restore_engine`), once the engine has built its state.

    Parameters
    ----------
    dyn : BatchedDynamics
        A freshly constructed object that :func:`check_matches` accepted.
    checkpoint : Checkpoint
        The checkpoint.
    """
    batch = dyn.batch
    saved = checkpoint.group("batch")
    with torch.no_grad():
        for key in BATCH_FIELDS:
            if key not in saved:
                raise CheckpointError(
                    f"restart file {checkpoint.path}: field 'batch/{key}' is missing; "
                    + _FIX
                )
            _put(batch, key, saved[key], checkpoint.path)
    device = batch.device
    dyn._guard.load_state(
        {
            key: torch.as_tensor(value, device=device)
            for key, value in checkpoint.group("failures").items()
        }
    )
    dyn._restore_checkpoint_extras(checkpoint.group("extra"))
    dyn.nsteps = int(checkpoint.meta["nsteps"])
    seed = checkpoint.meta.get("random_seed")
    if seed is not None:
        if hasattr(dyn, "seed"):
            dyn.seed = int(seed)
        if isinstance(getattr(type(dyn.engine), "random_seed", None), property):
            dyn.engine.random_seed = int(seed)


def restore_engine(dyn: BatchedDynamics, checkpoint: Checkpoint) -> None:
    """Give the primed engine its checkpointed state, list and model outputs.

    Called once, right after the evaluation that primes the continued run
    (which builds the engine's state and a neighbour list), before any step.

    Parameters
    ----------
    dyn : BatchedDynamics
        The object :func:`restore_structures` filled.
    checkpoint : Checkpoint
        The same checkpoint.

    Raises
    ------
    CheckpointError
        If the engine's state has other fields or shapes than the checkpoint's.
    """
    batch, engine, path = dyn.batch, dyn.engine, checkpoint.path
    saved = checkpoint.group("engine")
    fit = getattr(engine, "fit_checkpoint_state", None)
    if fit is not None:  # padded state: a refilled batch's may be wider
        fit(saved)
    live = {key: value for key, value in engine_state(engine) or ()}
    if set(saved) != set(live):
        raise CheckpointError(
            f"restart file {path}: field 'engine' holds {sorted(saved)} but this "
            f"{type(engine).__name__} holds {sorted(live)}; {_FIX}"
        )
    for key, value in saved.items():
        if tuple(value.shape) != tuple(live[key].shape):
            raise CheckpointError(
                f"restart file {path}: engine field {key!r} has shape "
                f"{tuple(value.shape)} in the checkpoint but "
                f"{tuple(live[key].shape)} here (e.g. another history size); {_FIX}"
            )
    state: dict[str, Any] = {
        "step_count": int(checkpoint.meta.get("engine_step_count", 0)),
        "state": {
            key: torch.as_tensor(value, device=batch.device).to(live[key].dtype)
            for key, value in saved.items()
        },
    }
    if checkpoint.meta.get("random_seed") is not None:
        state["random_seed"] = int(checkpoint.meta["random_seed"])
    engine.load_state_dict(state)
    dyn._stress_step = int(checkpoint.meta.get("stress_step", -1))
    results = checkpoint.group("batch")
    with torch.no_grad():
        if STATUS_FIELD in results:
            _put(batch, STATUS_FIELD, results[STATUS_FIELD], path)
        elif STATUS_FIELD in batch:
            batch[STATUS_FIELD].zero_()
    if not _holds(batch, results):
        return  # the caller moved the structures since: fresh list and outputs
    for index, hook in enumerate(_neighbor_hooks(dyn)):
        fields = checkpoint.group(f"neighbors/{index}")
        load_neighbor_state(
            hook,
            {
                key: torch.as_tensor(value, device=batch.device)
                for key, value in fields.items()
            },
            batch,
        )
    with torch.no_grad():
        for key in RESULT_FIELDS:
            if key in results and key in batch:
                _put(batch, key, results[key], path)


def _holds(batch: Any, saved: dict[str, npt.NDArray[Any]]) -> bool:
    """Whether the batch still has the checkpoint's positions and cells."""
    return all(
        key in saved and np.array_equal(_host(batch[key]), saved[key])
        for key in ("positions", "cell")
    )


def _put(batch: Any, key: str, value: npt.NDArray[Any], path: Path) -> None:
    """Copy a saved array into the batch field ``key`` (created if absent)."""
    tensor = torch.as_tensor(value, device=batch.device)
    if key not in batch:
        batch[key] = tensor.clone()
        return
    target = batch[key]
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"restart file {path}: field 'batch/{key}' has shape "
            f"{tuple(tensor.shape)} but this run's has {tuple(target.shape)}; {_FIX}"
        )
    target.copy_(tensor.to(target.dtype))


def _neighbor_hooks(dyn: BatchedDynamics) -> list[Any]:
    return [hook for hook in dyn.engine.hooks if is_neighbor_hook(hook)]


def _host(value: torch.Tensor) -> npt.NDArray[Any]:
    return value.detach().cpu().numpy().copy()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from nvalchemi_ase import __version__

    found = {"nvalchemi_ase": __version__, "torch": torch.__version__}
    for name in ("nvalchemi-toolkit", "ase"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
