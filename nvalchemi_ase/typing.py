"""Names for the argument types of the public constructors.

What ``NVAlchemiCalculator``, :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`
and the ``md``/``optimize`` classes accept, named once so that the signatures say
it and type checkers check it:

=================  ============================================================
``ImagesLike``     one ``Atoms`` or ASE cell filter, or a sequence of them
``ModelLike``      a model name (``"lj"``, ``"sevennet-0"``) or an nvalchemi model
``DeviceLike``     ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or None
                   (CUDA when available)
``LogfileLike``    ``"-"`` (stdout), a path (``{i}`` for one log per structure),
                   an open text file, or None
``TrajectoryLike`` a path (``{i}`` for one file per structure), an open ASE
                   ``Trajectory``, a sequence of one of them per structure, or None
``RNGLike``        a NumPy ``Generator`` or ``RandomState`` (ASE's ``rng``), or None
=================  ============================================================

The aliases are for annotations: importing this module imports neither torch nor
nvalchemi, so each is a forward reference (a string) at run time, resolved by the
type checker. The dtype argument's type is
:data:`nvalchemi_ase.devices.DtypeLike`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Sequence
    from os import PathLike
    from typing import IO

    import numpy as np
    import torch
    from ase import Atoms
    from ase.filters import Filter
    from ase.io.trajectory import TrajectoryWriter
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "DeviceLike",
    "ImagesLike",
    "LogfileLike",
    "ModelLike",
    "RNGLike",
    "TrajectoryLike",
]

ImagesLike: TypeAlias = "Atoms | Filter | Sequence[Atoms] | Sequence[Filter]"
ModelLike: TypeAlias = "BaseModelMixin | str"
DeviceLike: TypeAlias = "torch.device | str | None"
LogfileLike: TypeAlias = "str | PathLike[str] | IO[str] | None"
TrajectoryLike: TypeAlias = (
    "str | PathLike[str] | TrajectoryWriter"
    " | Sequence[str | PathLike[str] | TrajectoryWriter] | None"
)
RNGLike: TypeAlias = "np.random.Generator | np.random.RandomState | None"
