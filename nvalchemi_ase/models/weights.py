"""Where named models' weight files live, and the error when one is missing.

Nothing in :mod:`nvalchemi_ase` downloads weights. Models whose weights do not
ship inside a package (MACE foundation models, AIMNet2, UMA, ...) are read from
one folder, :func:`weights_dir`: ``$NVALCHEMI_ASE_WEIGHTS`` when set, otherwise
``~/.cache/nvalchemi_ase/weights``. A missing file is a
:class:`MissingWeightsError` naming the file, where to get it and where to put
it, raised before any work starts.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["WEIGHTS_ENV", "MissingWeightsError", "find_weights", "weights_dir"]

#: The environment variable that overrides :func:`weights_dir`.
WEIGHTS_ENV = "NVALCHEMI_ASE_WEIGHTS"


class MissingWeightsError(FileNotFoundError):
    """A named model's weight file is not in the weights folder."""


def weights_dir() -> Path:
    """Return the folder named models' weight files are read from.

    Returns
    -------
    pathlib.Path
        ``$NVALCHEMI_ASE_WEIGHTS`` when set (``~`` expanded), otherwise
        ``~/.cache/nvalchemi_ase/weights``. It need not exist.
    """
    override = os.environ.get(WEIGHTS_ENV)
    if override:
        return Path(override).expanduser()
    return Path("~/.cache/nvalchemi_ase/weights").expanduser()


def find_weights(model: str, filename: str, source: str) -> Path:
    """Return the path of a named model's weight file, or explain how to get it.

    Parameters
    ----------
    model : str
        The model's name, for the message (e.g. ``"mace-mp-0-medium"``).
    filename : str
        The file's name inside :func:`weights_dir`.
    source : str
        Where a user can download it (an address or the command that fetches it).

    Returns
    -------
    pathlib.Path
        The existing file.

    Raises
    ------
    MissingWeightsError
        If the file is not there; the message names the file, ``source`` and the
        folder (and ``$NVALCHEMI_ASE_WEIGHTS``).
    """
    folder = weights_dir()
    path = folder / filename
    if path.is_file():
        return path
    raise MissingWeightsError(
        f"{model}: weights file {filename!r} not found in {folder} "
        f"(set ${WEIGHTS_ENV} to use another folder). nvalchemi_ase never downloads "
        f"weights: get the file from {source} and save it as {path}"
    )
