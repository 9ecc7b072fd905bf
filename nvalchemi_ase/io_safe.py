"""Metadata that extxyz cannot hold as it is, encoded so every frame reads back.

ASE writes any ``info``/``arrays`` content into an extxyz comment line, but
reads back only some of it: a newline in ``info["comment"]`` splits the frame
(the file no longer parses), ``=`` in a key, a tab, a backslash, an empty
string, ``None`` or a string like ``"1.0"`` come back as something else, and a
string per-atom array with a space shifts every column after it. Every extxyz
frame this package writes goes through :func:`encoded_frame`, and every frame
it reads back through :func:`decoded_frame`:

* an ``info`` entry survives as it is when ASE's own comment-line writer and
  parser give it back equal (key and value); any other is moved, as JSON, into
  the single entry :data:`ENCODED_KEY`, percent-encoded (letters, digits and
  ``_.-~%`` only, which ASE keeps verbatim);
* a per-atom array whose name is not a plain identifier, or of strings that
  are not plain words, is moved there as well (as a list of its rows).

``ase.io.read`` of such a file gives every frame with its positions, cell and
results, the odd metadata readable in one entry;
:func:`~nvalchemi_ase.runners.read_results` (and :func:`decoded_frame`) give
the original ``info`` and ``arrays`` back.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ase import Atoms

__all__ = ["ENCODED_KEY", "decoded_frame", "encoded_frame", "write_frames"]

#: The ``info`` key holding the entries moved out of a frame (percent-encoded JSON).
ENCODED_KEY = "nvalchemi_encoded"
#: Array names and string cells extxyz's column format keeps as they are.
_PLAIN_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Arrays ASE writes itself (positions, numbers, results): never moved.
_ASE_ARRAYS = frozenset({"positions", "numbers", "species", "pos", "Z"})


def encoded_frame(atoms: Atoms) -> Atoms:
    """Return ``atoms`` ready for extxyz: unsafe metadata moved to one entry.

    Parameters
    ----------
    atoms : ase.Atoms
        A frame to write (not modified).

    Returns
    -------
    ase.Atoms
        ``atoms`` itself when nothing needs encoding, else a copy (same
        calculator) whose ``info`` and ``arrays`` hold only what extxyz gives
        back unchanged, plus :data:`ENCODED_KEY` for the rest.
    """
    moved_info = {
        key: value for key, value in atoms.info.items() if not _survives(key, value)
    }
    moved_arrays = {
        key: value
        for key, value in atoms.arrays.items()
        if key not in _ASE_ARRAYS and not _plain_array(key, value)
    }
    if not moved_info and not moved_arrays:
        return atoms
    frame = atoms.copy()
    frame.calc = atoms.calc
    for key in moved_info:
        del frame.info[key]
    for key in moved_arrays:
        del frame.arrays[key]
    record = {
        "info": [[key, _to_json(value)] for key, value in moved_info.items()],
        "arrays": [[key, _to_json(value)] for key, value in moved_arrays.items()],
    }
    text = json.dumps(record, ensure_ascii=False, allow_nan=True)
    frame.info[ENCODED_KEY] = urllib.parse.quote(text, safe="")
    return frame


def write_frames(
    target: str | os.PathLike[str] | Any,
    frames: Atoms | Iterable[Atoms],
    format: str | None = None,
) -> None:
    """``ase.io.write`` whose extxyz frames always read back (:func:`encoded_frame`).

    Parameters
    ----------
    target : str, path or file
        Where to write.
    frames : ase.Atoms or iterable of ase.Atoms
        The frames (not modified).
    format : str, optional
        ASE's format name; by default from the file name. Only ``extxyz``
        and ``xyz`` (extended) frames are encoded; other formats (``traj``)
        keep ``info`` as they are.
    """
    from ase import Atoms as AtomsClass
    from ase.io import write
    from ase.io.formats import filetype

    frames = [frames] if isinstance(frames, AtomsClass) else list(frames)
    name = format
    if name is None and isinstance(target, str | os.PathLike):
        name = filetype(os.fspath(target), read=False)
    if name in ("extxyz", "xyz"):
        frames = [encoded_frame(atoms) for atoms in frames]
    write(
        target if not isinstance(target, os.PathLike) else os.fspath(target),
        frames,
        format=format,
    )


def decoded_frame(atoms: Atoms) -> Atoms:
    """Put the entries :func:`encoded_frame` moved back into ``atoms`` (in place).

    Parameters
    ----------
    atoms : ase.Atoms
        A frame as read from extxyz.

    Returns
    -------
    ase.Atoms
        The same object, its ``info``/``arrays`` as before encoding (tuples
        and other JSON-less types come back as lists or strings).
    """
    encoded = atoms.info.pop(ENCODED_KEY, None)
    if not isinstance(encoded, str):
        return atoms
    record = json.loads(urllib.parse.unquote(encoded))
    for key, value in record.get("info", []):
        atoms.info[key] = _from_json(value)
    for key, value in record.get("arrays", []):
        atoms.arrays[key] = np.asarray(_from_json(value))
    return atoms


def _survives(key: Any, value: Any) -> bool:
    """Whether ASE's comment-line writer and parser give ``{key: value}`` back."""
    from ase.io.extxyz import key_val_dict_to_str, key_val_str_to_dict

    if not isinstance(key, str) or key == ENCODED_KEY:
        return False
    if isinstance(value, str) and (not value or not value.isprintable()):
        return False
    try:
        back = key_val_str_to_dict(key_val_dict_to_str({key: value}))
    except Exception:  # anything ASE's parser chokes on
        return False
    if list(back) != [key]:
        return False
    return _equal(back[key], value)


def _equal(read: Any, written: Any) -> bool:
    if isinstance(written, bool) or isinstance(read, bool):
        return type(read) is type(written) and read == written
    if isinstance(written, str) or isinstance(read, str):
        return type(read) is type(written) and read == written
    if isinstance(written, dict) or isinstance(read, dict):
        return False  # ASE writes dicts as JSON and reads some back changed
    try:
        a, b = np.asarray(read), np.asarray(written)
    except Exception:
        return False
    if a.dtype.kind not in "biuf" or b.dtype.kind not in "biuf":
        return False
    return (
        a.shape == b.shape
        and (a.dtype.kind == "f") == (b.dtype.kind == "f")
        and bool(np.array_equal(a, b, equal_nan=True))
    )


def _plain_array(key: str, value: Any) -> bool:
    """Whether extxyz's columns hold this per-atom array as it is."""
    if not _PLAIN_WORD.match(key):
        return False
    array = np.asarray(value)
    if array.dtype.kind in "biuf":
        return True
    if array.dtype.kind == "U":
        return all(_PLAIN_WORD.match(str(cell)) for cell in array.ravel())
    return False


def _to_json(value: Any) -> Any:
    """``value`` as JSON data, NumPy arrays and scalars included."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {"__dict__": [[str(k), _to_json(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [_to_json(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return {"__repr__": repr(value)}


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.array(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
        if "__dict__" in value:
            return {k: _from_json(v) for k, v in value["__dict__"]}
        if "__repr__" in value:
            return value["__repr__"]
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value
