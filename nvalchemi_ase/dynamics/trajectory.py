"""One ASE trajectory per structure, written the way ASE's dynamics write theirs.

A trajectory target is a path template containing ``{i}`` (the structure's index
in ``images``), a list of paths or open ``Trajectory`` objects (one per
structure), or, for a single structure, one path or ``Trajectory``. As in ASE,
a path is deleted when the dynamics object is created unless
``append_trajectory=True``; frames carry the calculator results (energy, forces,
stress where defined), so ``ase gui`` and ``ase.io.read`` show them.

Targets are checked when the dynamics object is created, before any file is
touched: two structures may not share a file (``[p, p]``, ``"a.traj"`` and
``"./a.traj"``, a template whose expansion repeats, or one open ``Trajectory``
given twice) because interleaved frames make the file unreadable, and a path's
directory must exist (``FileNotFoundError``, which ASE's ``Trajectory`` raises
when it opens the file; ASE 3.29's dynamics open it only when the run starts).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from ase import Atoms

__all__ = ["TrajectorySet", "check_distinct_paths", "expand_template", "truncate"]

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
        _check_targets(self._targets)
        self._description = description
        self._writers: dict[int, Any] = {}
        #: Frames this set has written, per structure, shape (B,).
        self.written = np.zeros(count, dtype=np.int64)
        #: Whether existing files were kept to append to (``append_trajectory``).
        self.append = append
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

    def empty_mask(self) -> npt.NDArray[np.bool_]:
        """Which targets hold no frame yet, (B,): ASE writes frame 0 only into those."""
        from ase.io.trajectory import Trajectory

        empty = np.ones(len(self._targets), dtype=bool)
        for index, target in enumerate(self._targets):
            if isinstance(target, Path):
                if target.exists() and target.stat().st_size > 0:
                    with Trajectory(target, "r") as reader:
                        empty[index] = len(reader) == 0
            else:
                empty[index] = len(target) == 0
        return empty

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
            self.written[index] += 1

    def frame_counts(self) -> npt.NDArray[np.int64]:
        """Frames in each structure's file now, shape (B,) (-1: not a file).

        Returns
        -------
        numpy.ndarray of int
            0 for a file that does not exist yet.
        """
        from ase.io.trajectory import Trajectory

        counts = np.full(len(self._targets), -1, dtype=np.int64)
        for index, target in enumerate(self._targets):
            if not isinstance(target, Path):
                continue
            counts[index] = 0
            if target.exists() and target.stat().st_size > 0:
                with Trajectory(target, "r") as reader:
                    counts[index] = len(reader)
        return counts

    def truncate(self, frames: npt.NDArray[np.int64]) -> None:
        """Cut every file that holds more than ``frames[i]`` frames back to that.

        Used when a run continues from a checkpoint older than the last
        frames a killed run wrote (see :func:`truncate`).

        Parameters
        ----------
        frames : numpy.ndarray of int, shape (B,)
            Frames to keep per structure (negative: leave alone).
        """
        for index, target in enumerate(self._targets):
            keep = int(frames[index])
            if isinstance(target, Path) and keep >= 0:
                truncate(target, keep)

    def _writer(self, index: int) -> Any:
        writer = self._writers.get(index)
        if writer is None:
            from ase.io.trajectory import Trajectory

            target = self._targets[index]
            writer = target if not isinstance(target, Path) else Trajectory(target, "a")
            writer.set_description(self._description())
            self._writers[index] = writer
        return writer

    def resized(self, keep: npt.NDArray[np.intp], spec: list[Any]) -> TrajectorySet:
        """Return the set for structures ``keep`` of this one followed by new ones.

        Parameters
        ----------
        keep : numpy.ndarray of int
            The structures that stay (their targets and writers go on).
        spec : list of path or Trajectory
            One target per new structure (an existing file is replaced, as
            for a new set).

        Returns
        -------
        TrajectorySet
            Writing frames from now on; ``written`` counts from zero.
        """
        new_targets = _expand(spec, len(spec)) if spec else []
        resized = TrajectorySet(None, 0, append=True, description=self._description)
        resized._targets = [self._targets[k] for k in keep] + new_targets
        _check_targets(resized._targets)
        for position, index in enumerate(keep):
            if index in self._writers:
                resized._writers[position] = self._writers.pop(int(index))
        for target in new_targets:
            if isinstance(target, Path):
                target.unlink(missing_ok=True)
        resized.written = np.zeros(len(resized._targets), dtype=np.int64)
        resized.append = self.append
        self.close()  # the writers of structures that left
        return resized

    def close(self) -> None:
        """Close the files this object opened (open Trajectory objects stay open)."""
        for index, writer in self._writers.items():
            if isinstance(self._targets[index], Path):
                writer.close()
        self._writers.clear()


def truncate(path: Path, frames: int) -> None:
    """Cut the trajectory file ``path`` back to its first ``frames`` frames.

    The file is rewritten with those frames (temporary file, then
    ``os.replace``, so a kill leaves the old file whole); a file that holds
    no more than ``frames`` frames, or does not exist, is left alone.

    Parameters
    ----------
    path : pathlib.Path
        An ASE ``.traj`` file.
    frames : int
        Frames to keep (>= 0).
    """
    from ase.io.trajectory import Trajectory

    if not path.exists() or path.stat().st_size == 0:
        return
    with Trajectory(path, "r") as reader:
        if len(reader) <= frames:
            return
        kept = [reader[number] for number in range(frames)]
    temporary = path.with_name(f".{path.name}.truncated.tmp")
    with Trajectory(temporary, "w") as writer:
        for atoms in kept:
            writer.write(atoms)
    os.replace(temporary, path)


def _expand(spec: TrajectorySpec, count: int) -> list[Any]:
    if spec is None:
        return []
    if isinstance(spec, str | PathLike):
        text = str(spec)
        if "{i" in text:
            return [
                Path(expand_template(text, index, "trajectory"))
                for index in range(count)
            ]
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


def expand_template(template: str, index: int, what: str) -> str:
    """Return a ``{i}`` path template for structure ``index``.

    Parameters
    ----------
    template : str
        E.g. ``"md_{i}.traj"`` or ``"md_{i:03d}.traj"``.
    index : int
        The structure's index in ``images``.
    what : str
        ``"trajectory"`` or ``"logfile"``, for the message.

    Returns
    -------
    str
        The path.

    Raises
    ------
    ValueError
        If the template has other fields (``{index}``, ``{}``) or a bad format.
    """
    try:
        return template.format(i=index)
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"{what}={template!r} cannot be expanded with i={index} ({error!r}); "
            "the only field is {i}, e.g. 'md_{i}.traj' or 'md_{i:03d}.traj'"
        ) from None


def check_distinct_paths(paths: Sequence[Path | None], what: str) -> None:
    """Raise unless the structures' files are distinct and their folders exist.

    Parameters
    ----------
    paths : sequence of Path or None
        One per structure (None: not a file, skipped).
    what : str
        ``"trajectory"`` or ``"logfile"``, for the message.

    Raises
    ------
    ValueError
        If two structures would write the same file (after resolving ``.``,
        ``..`` and symbolic links).
    FileNotFoundError
        If a path's directory does not exist.
    IsADirectoryError
        If a path is an existing directory.
    """
    seen: dict[Path, int] = {}
    for index, path in enumerate(paths):
        if path is None:
            continue
        resolved = path.resolve()
        first = seen.setdefault(resolved, index)
        if first != index:
            raise ValueError(
                f"{what}: images[{first}] and images[{index}] would both write "
                f"{str(path)!r}, and interleaved frames leave an unreadable file; "
                "give each structure its own path (a template such as "
                "'md_{i}.traj')"
            )
        if not resolved.parent.is_dir():
            raise FileNotFoundError(
                errno.ENOENT,
                f"{what} for images[{index}]: directory {str(path.parent)!r} does "
                "not exist; create it first (os.makedirs) or choose another path",
                str(path),
            )
        if resolved.is_dir():
            raise IsADirectoryError(
                errno.EISDIR,
                f"{what} for images[{index}] is a directory; give a file path",
                str(path),
            )


def _check_targets(targets: list[Any]) -> None:
    check_distinct_paths(
        [t if isinstance(t, Path) else None for t in targets], "trajectory"
    )
    seen: dict[int, int] = {}
    for index, target in enumerate(targets):
        if isinstance(target, Path):
            continue
        first = seen.setdefault(id(target), index)
        if first != index:
            raise ValueError(
                f"trajectory: images[{first}] and images[{index}] were given the "
                "same open Trajectory; frames of two structures in one file cannot "
                "be told apart. Give each structure its own trajectory"
            )
