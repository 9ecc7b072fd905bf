"""Log writers for batched runs (single structures use ASE's own formats).

One structure: the log is ASE's, column for column (``MDLogger`` for MD, the
optimizer line ``Name:  step HH:MM:SS energy fmax``). Several structures: a
``logfile`` path containing ``{i}`` gives every structure ASE's own log; any
other target gets one summary line per logged step:

* MD: ``Time[ps]``, the mean over structures of ``Etot/N``, ``Epot/N`` and
  ``Ekin/N`` (eV per atom), and the mean, minimum and maximum temperature (K);
* optimizers: step, wall time, structures converged / total, the mean energy
  per atom (eV) and the largest ``fmax`` (eV/Å) among structures still running.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import Any

from ase.optimize.optimize import Log
from ase.parallel import world

from nvalchemi_ase.dynamics.trajectory import check_distinct_paths, expand_template

__all__ = ["internal", "is_template", "log_paths", "open_log", "per_structure_targets"]


def is_template(logfile: Any) -> bool:
    """Whether ``logfile`` is a per-structure path template (contains ``{i}``)."""
    return isinstance(logfile, str) and "{i" in logfile


def per_structure_targets(logfile: str, count: int) -> list[str]:
    """Expand a ``{i}`` template into one path per structure.

    Parameters
    ----------
    logfile : str
        A template such as ``"md_{i}.log"``.
    count : int
        Number of structures B.

    Returns
    -------
    list of str
        B paths.

    Raises
    ------
    ValueError
        If the template has other fields, or two structures would share a file.
    FileNotFoundError
        If a path's directory does not exist (ASE's ``Log`` would raise it too,
        without naming the structure).
    """
    paths = [expand_template(logfile, index, "logfile") for index in range(count)]
    check_distinct_paths([Path(path) for path in paths], "logfile")
    return paths


def log_paths(logfile: Any, count: int) -> list[str]:
    """Return the files a ``logfile`` argument makes a dynamics object append to.

    Parameters
    ----------
    logfile : file, str, path or None
        The argument (``"-"``, an open file and None name no file).
    count : int
        Number of structures B (for a ``{i}`` template).

    Returns
    -------
    list of str
        One path, B paths for a template, or none.
    """
    if logfile is None or logfile == "-" or not isinstance(logfile, str | PathLike):
        return []
    if is_template(logfile):
        return per_structure_targets(str(logfile), count)
    return [str(logfile)]


def open_log(logfile: Any) -> Log:
    """Return ASE's ``Log`` writer: ``"-"`` is stdout, a path is appended to."""
    return Log(logfile, comm=world)


def internal(
    function: Callable[..., Any], *, needs_stress: bool = False
) -> Callable[..., Any]:
    """Mark an observer that reads the batch itself (no ``Atoms`` copy needed).

    Parameters
    ----------
    function : callable
        The observer.
    needs_stress : bool
        Ask the model for stress on the steps where this observer is due.

    Returns
    -------
    callable
        ``function`` with ``needs_atoms = False`` and ``needs_stress`` set.
    """
    wrapped = functools.partial(function)
    wrapped.needs_atoms = False  # type: ignore[attr-defined]
    wrapped.needs_stress = needs_stress  # type: ignore[attr-defined]
    return wrapped
