"""One ASE trajectory per structure, written the way ASE's dynamics write theirs.

A trajectory target is a path template containing ``{i}`` (the structure's index
in ``images``), a list of paths or open ``Trajectory`` objects (one per
structure), or, for a single structure, one path or ``Trajectory``. As in ASE,
a path is deleted when the dynamics object is created unless
``append_trajectory=True``; frames carry the calculator results (energy, forces,
stress where defined), so ``ase gui`` and ``ase.io.read`` show them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from ase import Atoms

__all__ = ["TrajectorySet"]

TrajectorySpec = str | PathLike[str] | Any | Sequence[str | PathLike[str] | Any] | None


class TrajectorySet:
    """Per-structure trajectory writers.

    Parameters
    ----------
    spec : str, path, Trajectory, sequence of them, or None
        The targets (see the module docstring).
    count : int
        Number of structures B.
    append : bool
        Keep existing files and append (ASE's ``append_trajectory``).
    description : callable
        Returns the header description (``dyn.todict() | {"interval": ...}``).
    """

    def __init__(
        self,
        spec: TrajectorySpec,
        count: int,
        *,
        append: bool,
        description: Callable[[], dict[str, Any]],
    ) -> None:
        self._targets = _expand(spec, count)
        self._description = description
        self._writers: dict[int, Any] = {}
        if not append:
            for target in self._targets:
                if isinstance(target, Path):
                    target.unlink(missing_ok=True)

    def __bool__(self) -> bool:
        return bool(self._targets)

    @property
    def paths(self) -> list[Path | None]:
        """Paths of the per-structure files (None for open Trajectory objects)."""
        return [t if isinstance(t, Path) else None for t in self._targets]

    def is_empty(self) -> bool:
        """Whether no target holds a frame yet (ASE writes frame 0 only then)."""
        from ase.io.trajectory import Trajectory

        for target in self._targets:
            if isinstance(target, Path):
                if target.exists() and target.stat().st_size > 0:
                    with Trajectory(target, "r") as reader:
                        if len(reader) > 0:
                            return False
            elif len(target) > 0:
                return False
        return True

    def write(self, images: Sequence[Atoms], active: npt.NDArray[np.bool_]) -> None:
        """Append the current frame of every active structure.

        Parameters
        ----------
        images : sequence of ase.Atoms
            The B structures, already updated to the current step.
        active : numpy.ndarray, shape (B,), bool
            Structures to write (optimizers stop writing a structure once it has
            converged, as ASE's optimizer for it would have stopped).
        """
        for index in map(int, np.flatnonzero(active)):
            self._writer(index).write(images[index])

    def _writer(self, index: int) -> Any:
        writer = self._writers.get(index)
        if writer is None:
            from ase.io.trajectory import Trajectory

            target = self._targets[index]
            writer = target if not isinstance(target, Path) else Trajectory(target, "a")
            writer.set_description(self._description())
            self._writers[index] = writer
        return writer

    def close(self) -> None:
        """Close the files this object opened (open Trajectory objects stay open)."""
        for index, writer in self._writers.items():
            if isinstance(self._targets[index], Path):
                writer.close()
        self._writers.clear()


def _expand(spec: TrajectorySpec, count: int) -> list[Any]:
    if spec is None:
        return []
    if isinstance(spec, str | PathLike):
        text = str(spec)
        if "{i" in text:
            return [Path(text.format(i=index)) for index in range(count)]
        if count != 1:
            raise ValueError(
                f"trajectory={text!r} is one file for {count} structures; use a "
                "template such as 'run_{i}.traj' or a list of one path per structure"
            )
        return [Path(text)]
    if hasattr(spec, "write"):
        if count != 1:
            raise ValueError(
                f"one open Trajectory for {count} structures; pass a list of "
                "trajectories or a path template with {i}"
            )
        return [spec]
    targets = list(spec)
    if len(targets) != count:
        raise ValueError(
            f"trajectory has {len(targets)} entries for {count} structures; give "
            "one path or Trajectory per structure"
        )
    return [t if hasattr(t, "write") else Path(t) for t in targets]
