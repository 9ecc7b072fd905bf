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
                                  whether each was put back, reference volumes
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
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from ase.optimize.optimize import RestartError

from nvalchemi_ase.dynamics.job import IDENTITY_ARRAY, job_entries, job_mismatch

if TYPE_CHECKING:
    from ase import Atoms

__all__ = [
    "DEFAULT_RESTART_INTERVAL",
    "FORMAT",
    "VERSION",
    "Capturable",
    "Checkpoint",
    "CheckpointError",
    "Described",
    "capture",
    "check_matches",
    "checkpoint_fix",
    "host_array",
    "put_array",
    "read_checkpoint",
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


class Described(Protocol):
    """What a checkpoint must match: the public face of a dynamics object."""

    @property
    def images(self) -> list[Atoms]:
        """The structures."""

    @property
    def model(self) -> Any:
        """The nvalchemi model."""

    @property
    def engine(self) -> Any:
        """The nvalchemi engine."""

    @property
    def setup(self) -> Any:
        """Model, device and dtype (``dtype`` is read)."""

    @property
    def cell_filter(self) -> Any:
        """The cell filter's spec (``kind`` is read), or None."""

    def todict(self) -> dict[str, Any]:
        """ASE's description of the run's parameters."""


class Capturable(Protocol):
    """A run that gives its state as plain arrays (``BatchRun``)."""

    def capture(self) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
        """Return counters (step count, seed, stress step) and arrays."""


# ----------------------------------------------------------------------------
# The file
# ----------------------------------------------------------------------------


#: Engine names in checkpoints written before the rename (the ASE
#: algorithms' engines were ``FIRE``/``BFGS``/``MDMin``, beside nvalchemi's FIRE).
_LEGACY_ENGINE_NAMES = {"FIRE": "ASEFIRE", "BFGS": "ASEBFGS", "MDMin": "ASEMDMin"}


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


def identity(owner: Described) -> dict[str, Any]:
    """Describe what a checkpoint must match to continue ``owner``.

    Parameters
    ----------
    owner : Described
        The ASE-facing dynamics object.

    Returns
    -------
    dict
        ``class``, ``engine``, ``n_structures``, ``n_atoms``, ``dtype``,
        ``model``, ``model_outputs``, ``cell_filter`` and ``parameters``
        (``todict()`` without entries that may change between runs).
    """
    outputs = owner.model.model_config.outputs
    return {
        "class": type(owner).__name__,
        "engine": type(owner.engine).__name__,
        "n_structures": len(owner.images),
        "n_atoms": [len(atoms) for atoms in owner.images],
        "dtype": str(owner.setup.dtype).removeprefix("torch."),
        "model": type(owner.model).__name__,
        "model_outputs": sorted(str(getattr(o, "value", o)) for o in outputs),
        "cell_filter": None if owner.cell_filter is None else owner.cell_filter.kind,
        "parameters": _parameters(owner),
    }


def check_matches(owner: Described, checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint written for other structures, another class or model.

    Parameters
    ----------
    owner : Described
        The object that would continue from ``checkpoint``.
    checkpoint : Checkpoint
        What :func:`read_checkpoint` returned.

    Raises
    ------
    CheckpointError
        Naming the file, the first field that differs, both values and the fix.
    """
    path, meta = checkpoint.path, checkpoint.meta
    current = identity(owner)
    saved_engine = meta.get("engine")
    saved_engine = _LEGACY_ENGINE_NAMES.get(str(saved_engine), saved_engine)
    _same(path, "class", meta.get("class"), current["class"])
    _same(path, "engine", saved_engine, current["engine"])
    for field in ("n_structures", "n_atoms"):
        _same(path, field, meta.get(field), current[field])
    numbers = np.concatenate([atoms.numbers for atoms in owner.images])
    saved_numbers = checkpoint.arrays.get("structures/atomic_numbers")
    if saved_numbers is None or not np.array_equal(saved_numbers, numbers):
        index = _first_structure_differing(owner, saved_numbers)
        raise CheckpointError(
            f"restart file {path}: field 'atomic_numbers' differs for images[{index}] "
            f"(the checkpoint was written for other atoms); {_FIX}"
        )
    pbc = np.stack([atoms.pbc for atoms in owner.images])
    saved_pbc = checkpoint.arrays.get("structures/pbc")
    if saved_pbc is None or not np.array_equal(saved_pbc, pbc):
        raise CheckpointError(
            f"restart file {path}: field 'pbc' is "
            f"{None if saved_pbc is None else saved_pbc.tolist()} in the checkpoint "
            f"but {pbc.tolist()} here; {_FIX}"
        )
    for field in ("dtype", "model", "model_outputs", "cell_filter", "parameters"):
        _same(path, field, meta.get(field), current[field])
    mismatch = job_mismatch(  # hook: job identity
        owner.images, owner.model, owner.setup.dtype, meta, checkpoint.arrays
    )
    if mismatch is not None:
        raise CheckpointError(f"restart file {path}: {mismatch}; {_FIX}")


def _same(path: Path, field: str, saved: Any, current: Any) -> None:
    if saved != current:
        raise CheckpointError(
            f"restart file {path}: field {field!r} is {saved!r} in the checkpoint "
            f"but {current!r} here; {_FIX}"
        )


def _first_structure_differing(owner: Described, saved: npt.NDArray[Any] | None) -> int:
    if saved is None:
        return 0
    start = 0
    for index, atoms in enumerate(owner.images):
        stop = start + len(atoms)
        if not np.array_equal(saved[start:stop], atoms.numbers):
            return index
        start = stop
    return 0


def _parameters(owner: Described) -> dict[str, Any]:
    """``owner.todict()`` as JSON would give it back, without volatile entries."""
    description = {
        key: value
        for key, value in owner.todict().items()
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
# Capture: the owner's description, the run's arrays, the owner's extras
# ----------------------------------------------------------------------------


def capture(
    owner: Described,
    run: Capturable,
    *,
    nsteps: int,
    extras: dict[str, npt.NDArray[Any]],
    job_inputs: npt.NDArray[np.uint64] | None = None,
) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """Everything the next step depends on, for :func:`write_checkpoint`.

    Parameters
    ----------
    owner : Described
        The ASE-facing object (what a continuation must match).
    run : Capturable
        Its primed run (:class:`~nvalchemi_ase.dynamics.run.BatchRun`).
    nsteps : int
        ASE's step counter.
    extras : dict of numpy.ndarray
        The owner's own arrays (``extra/<name>``).
    job_inputs : numpy.ndarray, optional
        (B, F) digests of the structures the run started from
        (:mod:`nvalchemi_ase.dynamics.job`).

    Returns
    -------
    meta : dict
        JSON metadata.
    arrays : dict of numpy.ndarray
        Host copies of the state (see the module docstring).
    """
    counters, run_arrays = run.capture()
    arrays: dict[str, npt.NDArray[Any]] = {
        "structures/atomic_numbers": np.concatenate(
            [atoms.numbers for atoms in owner.images]
        ),
        "structures/pbc": np.stack([atoms.pbc for atoms in owner.images]),
        **run_arrays,
    }
    for key, value in extras.items():
        arrays[f"extra/{key}"] = np.asarray(value)
    job_meta, job_arrays = job_entries(owner.model, owner.setup.dtype, job_inputs)
    arrays |= job_arrays  # hook: job identity
    meta = (
        identity(owner)
        | job_meta
        | {
            "nsteps": int(nsteps),
            **counters,
            "written": datetime.datetime.now(datetime.UTC).isoformat(
                timespec="seconds"
            ),
            "versions": _versions(),
        }
    )
    return meta, arrays


def checkpoint_fix() -> str:
    """Return the fix every mismatch message ends with."""
    return _FIX


def put_array(batch: Any, key: str, value: npt.NDArray[Any], path: Path) -> None:
    """Copy a saved array into the batch field ``key`` (created if absent).

    Raises
    ------
    CheckpointError
        If the field exists with another shape.
    """
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


def host_array(value: torch.Tensor) -> npt.NDArray[Any]:
    """Return a host copy of ``value``."""
    return value.detach().cpu().numpy().copy()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from nvalchemi_ase import __version__

    found = {"nvalchemi_ase": __version__, "torch": torch.__version__}
    for name in ("nvalchemi-toolkit", "ase"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
