"""The table of named models: what each name builds and what a user should know of it.

Every name :func:`nvalchemi_ase.models.load_model` accepts has one
:class:`ModelInfo` here: the factory that builds it through nvalchemi's (or the
model package's) own wrapper, and the facts ``nvalchemi-ase models`` lists
(elements, cutoff, dtype, licence, the extra to install, where the weights come
from). Model families add their entries with :func:`register` when
:mod:`nvalchemi_ase.models` is imported; importing a family's module must not
import its model package (that happens when the factory is called).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ModelInfo", "entries", "lookup", "names", "register"]


@dataclass(frozen=True)
class ModelInfo:
    """One named model.

    Attributes
    ----------
    name : str
        The canonical name, lower case (e.g. ``"sevennet-0"``).
    factory : callable
        Builds the model (a ``BaseModelMixin`` on the CPU) from keyword
        parameters in ASE units.
    summary : str
        One line: what the model is.
    elements : str
        Which elements it evaluates, in words (``"89 (H-Pu)"``, ``"any"``).
    cutoff : str
        Interaction cutoff in words with its unit (``"5 Å"``, ``"none"``).
    dtype : str
        The dtype of its weights (``"float32"``), or ``"any"`` for analytic models.
    licence : str
        The licence of the weights (or of the code for analytic models).
    extra : str or None
        The ``pip install "nvalchemi-ase[EXTRA]"`` extra it needs, or None.
    weights : str
        Where the weights come from (``"ship in the sevenn wheel"``, a download
        address and the file name to put in the weights folder,
        :func:`nvalchemi_ase.models.weights.weights_dir`; ``"none"``).
    aliases : tuple of str
        Other names for the same model.
    weights_file : str or None
        The file's name in the weights folder, for models read from it (lets
        ``nvalchemi-ase models`` say whether it is there); None otherwise.
    """

    name: str
    factory: Callable[..., BaseModelMixin]
    summary: str
    elements: str
    cutoff: str
    dtype: str
    licence: str
    extra: str | None = None
    weights: str = "none"
    aliases: tuple[str, ...] = field(default=())
    weights_file: str | None = None

    def as_row(self) -> dict[str, Any]:
        """Return the facts as a plain dict (tables, JSON), without the factory."""
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "summary": self.summary,
            "elements": self.elements,
            "cutoff": self.cutoff,
            "dtype": self.dtype,
            "licence": self.licence,
            "extra": self.extra,
            "weights": self.weights,
            "weights_file": self.weights_file,
        }


_ENTRIES: dict[str, ModelInfo] = {}
_NAMES: dict[str, str] = {}


def register(info: ModelInfo) -> ModelInfo:
    """Add a named model (its name and aliases must be new).

    Parameters
    ----------
    info : ModelInfo
        The entry.

    Returns
    -------
    ModelInfo
        ``info`` itself.

    Raises
    ------
    ValueError
        If the name or an alias is taken, or is not lower case.
    """
    for name in (info.name, *info.aliases):
        if name != name.lower() or "+" in name:
            raise ValueError(f"model name {name!r} must be lower case without '+'")
        if name in _NAMES:
            raise ValueError(f"model name {name!r} is already registered")
    _ENTRIES[info.name] = info
    for name in (info.name, *info.aliases):
        _NAMES[name] = info.name
    return info


def lookup(name: str) -> ModelInfo | None:
    """Return the entry for a name or alias (case-insensitive), or None."""
    canonical = _NAMES.get(name.lower())
    return None if canonical is None else _ENTRIES[canonical]


def entries() -> list[ModelInfo]:
    """Return every registered model, sorted by name."""
    return [_ENTRIES[name] for name in sorted(_ENTRIES)]


def names() -> list[str]:
    """Return every accepted name and alias, sorted."""
    return sorted(_NAMES)
