"""Job identity: a digest of what determines a run's results, for resume and restart.

A run's results depend on each input structure, on the model and on the
algorithm with its parameters. Every resumable artefact stores a digest of
each of the three (runner outputs: frame ``info``; ``restart=`` checkpoints:
their arrays and metadata), and a continued run compares them with its own
before any work, so results of another job are never mixed into this one.

Structures
    :func:`structure_digests` gives one 64-bit digest per structure and field
    (:data:`STRUCTURE_FIELDS`: atomic numbers, positions, cell, pbc, initial
    charges, the ``info`` entries the model reads (``charge``, ``spin``),
    constraints; :data:`MD_FIELDS` adds momenta and masses), bit-exact: any
    change of a stored bit changes it. The hash is vectorised: the fields of
    a whole chunk are concatenated once, every 64-bit word is mixed with its
    position inside its structure (splitmix64) and the words are summed per
    structure (``np.add.reduceat``, modulo 2**64); no Python loop runs over
    atoms. Only constraints, rare, are hashed structure by structure.
Model
    :func:`model_digest`: the class name, the dtype, a digest of every
    module's public scalar attributes (LJ's ``epsilon``, a MACE model's
    ``r_max``, ...) and one of the weights (every ``state_dict`` tensor:
    name, dtype, shape and bytes), computed once per model object.
Algorithm
    :func:`run_digest`: the kind of run and a digest of its parameters.

Digests are not secrets (a job's own files are trusted); they catch another
job's files, not a forger.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ase import Atoms

__all__ = [
    "MD_FIELDS",
    "STRUCTURE_FIELDS",
    "JobMismatchError",
    "decode",
    "differing_fields",
    "encode",
    "first_difference",
    "inputs_checked_by_caller",
    "inputs_checked_here",
    "model_digest",
    "run_digest",
    "structure_digests",
]

#: Format tag of an encoded structure digest (bumped if the hash changes).
VERSION = "v1"
#: What a single point or a relaxation depends on, per structure.
STRUCTURE_FIELDS = (
    "atomic_numbers",
    "positions",
    "cell",
    "pbc",
    "charges",
    "charge_spin",
    "constraints",
)
#: What MD also depends on: the initial momenta and the masses.
MD_FIELDS = (*STRUCTURE_FIELDS, "momenta", "masses")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


class JobMismatchError(ValueError):
    """Results or a checkpoint on disk belong to another job than the one asked for.

    Attributes
    ----------
    index : int or None
        The input index of the first structure that differs (None: the model
        or the algorithm differs for every structure).
    field : str
        What differs (``positions``, ``cell``, ``model``, ``run``, ...).
    """

    def __init__(self, message: str, *, index: int | None, field: str) -> None:
        super().__init__(message)
        self.index = index
        self.field = field


# ----------------------------------------------------------------------------
# Structures
# ----------------------------------------------------------------------------


def _mix(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, elementwise (wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        z = words + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


def _segment_hash(
    words: npt.NDArray[np.uint64], counts: npt.NDArray[np.int64], salt: int
) -> npt.NDArray[np.uint64]:
    """Order-sensitive 64-bit hash of consecutive segments of ``words``.

    ``counts[s]`` words belong to structure ``s``; each word is mixed with its
    position inside its segment and the field's ``salt``, then the segment's
    mixed words are summed (mod 2**64) together with its length.
    """
    n = len(counts)
    out = _mix(counts.astype(np.uint64) ^ np.uint64(salt))
    if words.size == 0:
        return out
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    local = np.arange(words.size, dtype=np.int64) - np.repeat(starts, counts)
    keyed = _mix(words ^ _mix(local.astype(np.uint64) * np.uint64(salt * 2 + 1)))
    nonempty = counts > 0
    with np.errstate(over="ignore"):
        sums = np.add.reduceat(keyed, starts[nonempty], dtype=np.uint64)
        out[nonempty] = _mix(out[nonempty] + sums)
    return out


def _words(array: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """Return the bits of a float64/int64 array as 64-bit words, flattened."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint64)


def _per_atom(
    images: Sequence[Atoms], field: str, counts: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    if field == "atomic_numbers":
        parts = [atoms.numbers.astype(np.int64) for atoms in images]
        width = 1
    elif field == "positions":
        parts = [atoms.positions.astype(np.float64) for atoms in images]
        width = 3
    elif field == "charges":
        parts = [
            np.asarray(atoms.arrays.get("initial_charges", ()), dtype=np.float64)
            for atoms in images
        ]
        return _concat(parts), np.array([p.size for p in parts], dtype=np.int64)
    elif field == "momenta":
        parts = [atoms.get_momenta().astype(np.float64) for atoms in images]
        width = 3
    else:  # masses
        parts = [atoms.get_masses().astype(np.float64) for atoms in images]
        width = 1
    return _concat(parts), counts * width


def _concat(parts: list[npt.NDArray[Any]]) -> npt.NDArray[np.uint64]:
    if not parts:
        return np.zeros(0, dtype=np.uint64)
    joined = np.concatenate([np.ravel(p) for p in parts])
    if joined.dtype.kind in "iub":
        joined = joined.astype(np.int64)
    else:
        joined = joined.astype(np.float64)
    return _words(joined)


def _info_number(atoms: Atoms, key: str) -> float:
    value = atoms.info.get(key)
    try:
        return float(value) if value is not None else float("nan")
    except (TypeError, ValueError):
        digest = hashlib.blake2b(str(value).encode(), digest_size=6).digest()
        return float(int.from_bytes(digest))


def _constraints_word(atoms: Atoms) -> int:
    if not atoms.constraints:
        return 0
    text = json.dumps(
        [c.todict() for c in atoms.constraints], sort_keys=True, default=_plain
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest())


def structure_digests(
    images: Sequence[Atoms], fields: Sequence[str] = STRUCTURE_FIELDS
) -> npt.NDArray[np.uint64]:
    """One 64-bit digest per structure and field, in one pass over the chunk.

    Parameters
    ----------
    images : sequence of ase.Atoms
        The structures (read, never modified).
    fields : sequence of str
        Among :data:`MD_FIELDS`, in the order of the columns.

    Returns
    -------
    numpy.ndarray
        (len(images), len(fields)) uint64.
    """
    n = len(images)
    counts = np.array([len(atoms) for atoms in images], dtype=np.int64)
    columns = []
    for salt, field in enumerate(fields, start=1):
        if field in ("atomic_numbers", "positions", "charges", "momenta", "masses"):
            words, lengths = _per_atom(images, field, counts)
        elif field == "cell":
            cells = np.array([atoms.cell.array for atoms in images], dtype=np.float64)
            words, lengths = _words(cells), np.full(n, 9, dtype=np.int64)
        elif field == "pbc":
            pbc = np.array([atoms.pbc for atoms in images], dtype=np.int64)
            words, lengths = _words(pbc), np.full(n, 3, dtype=np.int64)
        elif field == "charge_spin":
            values = np.array(
                [[_info_number(a, "charge"), _info_number(a, "spin")] for a in images],
                dtype=np.float64,
            )
            words, lengths = _words(values), np.full(n, 2, dtype=np.int64)
        elif field == "constraints":
            words = np.array([_constraints_word(a) for a in images], dtype=np.uint64)
            lengths = np.ones(n, dtype=np.int64)
        else:
            raise ValueError(f"unknown identity field {field!r}")
        columns.append(_segment_hash(words, lengths, salt))
    if not columns:
        return np.zeros((n, 0), dtype=np.uint64)
    return np.stack(columns, axis=1)


def encode(row: npt.NDArray[np.uint64]) -> str:
    """One structure's digests as text: ``v1.<hex>.<hex>...`` (never numeric)."""
    return ".".join([VERSION, *(f"{int(word):016x}" for word in row)])


def decode(text: Any) -> npt.NDArray[np.uint64] | None:
    """Invert :func:`encode`; None for anything else (an older file, no digest)."""
    if not isinstance(text, str) or not text.startswith(VERSION + "."):
        return None
    try:
        return np.array(
            [int(part, 16) for part in text.split(".")[1:]], dtype=np.uint64
        )
    except ValueError:
        return None


def differing_fields(
    saved: npt.NDArray[np.uint64],
    current: npt.NDArray[np.uint64],
    fields: Sequence[str],
) -> list[str]:
    """Return the names of the fields whose digests differ (all: other widths)."""
    if saved.shape != current.shape:
        return list(fields)
    return [name for name, a, b in zip(fields, saved, current, strict=True) if a != b]


def first_difference(
    saved: npt.NDArray[np.uint64],
    current: npt.NDArray[np.uint64],
    fields: Sequence[str] = STRUCTURE_FIELDS,
) -> tuple[int, list[str]] | None:
    """Return the first row of ``current`` whose digests differ from ``saved``, and how.

    Returns
    -------
    tuple of (int, list of str) or None
        The row and the names of its differing fields; None when all agree.
    """
    if saved.shape != current.shape:
        return 0, list(fields)
    rows = np.flatnonzero((saved != current).any(axis=1))
    if not rows.size:
        return None
    row = int(rows[0])
    return row, differing_fields(saved[row], current[row], fields)


# ----------------------------------------------------------------------------
# Model and algorithm
# ----------------------------------------------------------------------------

_WEIGHTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _plain(value: Any) -> Any:
    """Return a JSON stand-in that does not depend on memory addresses."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if hasattr(value, "detach"):  # a tensor
        return value.detach().cpu().tolist()
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return type(value).__qualname__


def _scalar_attributes(model: Any) -> list[Any]:
    """Return every (sub)module's type and public scalar attributes, in module order."""
    modules = (
        model.named_modules() if hasattr(model, "named_modules") else [("", model)]
    )
    found = []
    for name, module in modules:
        scalars = {
            key: value
            for key, value in vars(module).items()
            if not key.startswith("_")
            and key != "training"
            and (value is None or isinstance(value, bool | int | float | str))
        }
        found.append([name, type(module).__qualname__, sorted(scalars.items())])
    return found


def weights_digest(model: Any) -> str:
    """Return a digest of every ``state_dict`` tensor (name, dtype, shape, data)."""
    with contextlib.suppress(TypeError):
        cached = _WEIGHTS.get(model)
        if cached is not None:
            return cached
    digest = hashlib.blake2b(digest_size=8)
    state = model.state_dict() if hasattr(model, "state_dict") else {}
    for name, tensor in state.items():
        if not hasattr(tensor, "detach"):
            continue
        host = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{host.dtype}|{tuple(host.shape)}|".encode())
        digest.update(host.view(-1).view(dtype=_byte_dtype()).numpy().tobytes())
    text = digest.hexdigest()
    with contextlib.suppress(TypeError):
        _WEIGHTS[model] = text
    return text


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def model_digest(model: Any, dtype: Any) -> str:
    """``<class>.<dtype>.<parameters digest>.<weights digest>`` of a model.

    Parameters
    ----------
    model : torch.nn.Module
        The model as evaluated (the calculator's, on its device and dtype).
    dtype : torch.dtype or str
        The dtype it is evaluated in.
    """
    parameters = json.dumps(_scalar_attributes(model), default=_plain)
    return ".".join(
        (
            type(model).__name__,
            str(dtype).removeprefix("torch."),
            hashlib.blake2b(parameters.encode(), digest_size=8).hexdigest(),
            weights_digest(model),
        )
    )


#: What each part of :func:`model_digest` stands for, for messages.
MODEL_PARTS = ("class", "dtype", "parameters", "weights")


def model_difference(saved: str, current: str) -> str:
    """Name the parts of two model digests that differ, e.g. ``'parameters'``."""
    a, b = saved.split("."), current.split(".")
    if len(a) != len(b):
        return "class"
    names = [name for name, x, y in zip(MODEL_PARTS, a, b, strict=False) if x != y]
    return ", ".join(names) or "class"


def run_digest(kind: str, parameters: dict[str, Any]) -> str:
    """``<kind>.<digest of the parameters>`` of an algorithm (JSON, sorted keys)."""
    text = json.dumps(parameters, sort_keys=True, default=_plain)
    return f"{kind}.{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"


# ----------------------------------------------------------------------------
# Who checks the structures of a checkpoint
# ----------------------------------------------------------------------------

_CALLER_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "nvalchemi_ase_identity_caller_checks", default=False
)


@contextlib.contextmanager
def inputs_checked_by_caller() -> Iterator[None]:
    """Within: dynamics objects leave the structures' identity to their caller.

    The relaxation runner rebuilds its optimizer from moved structures at each
    refill, so it keeps the identity of its *inputs* itself (checkpoint tags)
    and checks them; the dynamics object still checks the model.
    """
    token = _CALLER_CHECKS.set(True)
    try:
        yield
    finally:
        _CALLER_CHECKS.reset(token)


def inputs_checked_here() -> bool:
    """Whether a dynamics object checks (and stores) its structures' identity."""
    return not _CALLER_CHECKS.get()


@dataclass(frozen=True)
class Job:
    """The identity of one runner call: model and algorithm, and the fields hashed."""

    model: str
    run: str
    fields: tuple[str, ...] = STRUCTURE_FIELDS
