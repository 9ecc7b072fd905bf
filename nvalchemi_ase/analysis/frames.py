"""Per-structure trajectories as arrays: what every analysis reads.

A structure's run is a sequence of frames: an ASE ``.traj``/extxyz file (as the
package's MD classes write with ``trajectory="md_{i}.traj"``), or a list of
``Atoms``. :func:`load_trajectories` turns each into a :class:`Frames` of
stacked float64 arrays, checking that every frame of a structure has the same
atoms. For ``.traj`` files written by ASE's or this package's MD the time
between frames is read from the header (``timestep * interval``); otherwise it
must be given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import numpy.typing as npt
from ase import Atoms
from ase.geometry import complete_cell

__all__ = ["Frames", "FramesLike", "load_trajectories"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Frames:
    """One structure's frames, stacked.

    Attributes
    ----------
    positions : numpy.ndarray, shape (T, N, 3)
        Cartesian positions, Å (wrapped or not).
    cells : numpy.ndarray, shape (T, 3, 3)
        Cells, Å (rows are lattice vectors; a missing vector on a non-periodic
        axis is completed with ASE's ``complete_cell``).
    pbc : numpy.ndarray, shape (3,), bool
        Periodic axes.
    numbers : numpy.ndarray, shape (N,), int
        Atomic numbers.
    masses : numpy.ndarray, shape (N,)
        Masses, amu.
    velocities : numpy.ndarray, shape (T, N, 3), or None
        Velocities, Å/ASE-time (momenta / masses), when every frame has momenta.
    stress : numpy.ndarray, shape (T, 3, 3), or None
        The calculator's stress, eV/Å³, tensile positive, virial part only
        (ASE's ``get_stress(voigt=False)``), when every frame has one.
    frame_interval : float or None
        Time between consecutive frames, ASE time units.
    full_cell : bool
        Whether every frame's cell has three lattice vectors (rank 3).
    label : str
        Where the frames came from (a path or ``images[i]``).
    """

    positions: FloatArray
    cells: FloatArray
    pbc: npt.NDArray[np.bool_]
    numbers: npt.NDArray[np.int64]
    masses: FloatArray
    velocities: FloatArray | None
    stress: FloatArray | None
    frame_interval: float | None
    label: str
    full_cell: bool = True

    @property
    def n_frames(self) -> int:
        """Number of frames T."""
        return int(self.positions.shape[0])

    @property
    def n_atoms(self) -> int:
        """Number of atoms N."""
        return int(self.positions.shape[1])

    @property
    def symbols(self) -> list[str]:
        """Chemical symbols of the N atoms."""
        return Atoms(numbers=self.numbers).get_chemical_symbols()


FramesLike = Union[str, "os.PathLike[str]", Sequence[Atoms], Frames]


def load_trajectories(
    trajectories: Sequence[FramesLike],
    frame_interval: float | Sequence[float | None] | None = None,
    *,
    need_interval: bool = True,
) -> list[Frames]:
    """Read every structure's frames into arrays.

    Parameters
    ----------
    trajectories : sequence of (path, sequence of Atoms, or Frames)
        One entry per structure: a trajectory file ASE reads (all frames), a
        list of ``Atoms`` (one per frame), or :class:`Frames`.
    frame_interval : float, sequence of float, or None
        Time between frames, ASE time units (e.g. ``10 * units.fs`` for a
        ``timestep=1 * units.fs`` run with ``loginterval=10``); one for all or
        one per structure. None: read ``timestep * interval`` from each
        ``.traj`` header.
    need_interval : bool
        Raise when a structure's interval is unknown (RDFs do not need it).

    Returns
    -------
    list of Frames
        In input order.

    Raises
    ------
    ValueError
        Naming the structure (and frame) whose input is unusable: no frames,
        frames with different atoms, or no known frame interval.
    """
    if isinstance(trajectories, str | os.PathLike | Atoms | Frames):
        raise TypeError(
            "trajectories must be a sequence with one entry per structure "
            "(paths, lists of Atoms or Frames); wrap a single one in a list"
        )
    count = len(trajectories)
    if count and isinstance(trajectories[0], Atoms):
        raise TypeError(
            "trajectories[0] is an Atoms: give one entry per structure (a list "
            "of frames each); wrap a single one in a list"
        )
    if count == 0:
        raise ValueError("trajectories is empty: give one entry per structure")
    intervals = _intervals(frame_interval, count)
    loaded = [
        _load_one(index, entry, intervals[index], need_interval)
        for index, entry in enumerate(trajectories)
    ]
    return loaded


def _intervals(
    frame_interval: float | Sequence[float | None] | None, count: int
) -> list[float | None]:
    if frame_interval is None or np.isscalar(frame_interval):
        return [frame_interval] * count  # type: ignore[list-item]
    values = list(frame_interval)  # type: ignore[arg-type]
    if len(values) != count:
        raise ValueError(
            f"frame_interval has {len(values)} values for {count} structures"
        )
    return values


def _load_one(
    index: int, entry: Any, interval: float | None, need_interval: bool
) -> Frames:
    name = f"trajectories[{index}]"
    header_interval = None
    if isinstance(entry, Frames):
        frames = entry
        if interval is not None:
            frames = _replace_interval(frames, interval)
        return _checked_interval(frames, name, need_interval)
    if isinstance(entry, str | os.PathLike):
        path = Path(entry)
        if not path.exists():
            raise ValueError(f"{name}: no such file {str(path)!r}")
        images, header_interval = _read_file(path, name)
        label = str(path)
    else:
        images = list(entry)
        label = name
        if not all(isinstance(atoms, Atoms) for atoms in images):
            raise ValueError(f"{name}: expected ase.Atoms frames")
    if not images:
        raise ValueError(f"{name} ({label}): no frames")
    frames = _stack(images, name, label)
    chosen = interval if interval is not None else header_interval
    return _checked_interval(_replace_interval(frames, chosen), name, need_interval)


def _checked_interval(frames: Frames, name: str, need_interval: bool) -> Frames:
    value = frames.frame_interval
    if value is not None and not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name}: frame_interval must be positive, got {value}")
    if need_interval and value is None:
        raise ValueError(
            f"{name} ({frames.label}): time between frames unknown; pass "
            "frame_interval= (ASE time units, timestep * loginterval)"
        )
    return frames


def _replace_interval(frames: Frames, interval: float | None) -> Frames:
    if interval is None:
        return frames
    values = {**frames.__dict__, "frame_interval": float(interval)}
    return Frames(**values)


def _read_file(path: Path, name: str) -> tuple[list[Atoms], float | None]:
    from ase.io import read

    try:
        images = read(path, index=":")
    except Exception as error:  # ASE raises many kinds for unreadable files
        raise ValueError(f"{name}: cannot read {str(path)!r}: {error}") from error
    interval = None
    if path.suffix == ".traj":
        from ase.io.trajectory import Trajectory

        with Trajectory(str(path)) as traj:
            description = getattr(traj, "description", {}) or {}
        timestep = description.get("timestep")
        steps = description.get("interval", 1)
        if timestep is not None:
            interval = float(timestep) * float(steps)
    return list(images), interval  # type: ignore[arg-type]


def _stack(images: list[Atoms], name: str, label: str) -> Frames:
    first = images[0]
    numbers = first.numbers.copy()
    for frame, atoms in enumerate(images):
        if len(atoms) != len(first) or not np.array_equal(atoms.numbers, numbers):
            raise ValueError(
                f"{name} ({label}) frame {frame}: atoms differ from frame 0 "
                f"({atoms.get_chemical_formula()} vs {first.get_chemical_formula()})"
            )
    pbc = first.pbc.copy()
    positions = np.stack([atoms.positions for atoms in images]).astype(np.float64)
    cells = np.stack([complete_cell(atoms.cell) for atoms in images])
    velocities = None
    if all(atoms.has("momenta") for atoms in images):
        velocities = np.stack([atoms.get_velocities() for atoms in images])
    stress = _stresses(images)
    return Frames(
        positions=positions,
        cells=cells.astype(np.float64),
        pbc=pbc,
        numbers=numbers.astype(np.int64),
        masses=first.get_masses().astype(np.float64),
        velocities=velocities,
        stress=stress,
        frame_interval=None,
        label=label,
        full_cell=all(atoms.cell.rank == 3 for atoms in images),
    )


def _stresses(images: list[Atoms]) -> FloatArray | None:
    values = []
    for atoms in images:
        results = getattr(atoms.calc, "results", None) or {}
        stress = results.get("stress")
        if stress is None:
            return None
        values.append(_voigt_to_3x3(np.asarray(stress, dtype=np.float64)))
    return np.stack(values)


def _voigt_to_3x3(stress: FloatArray) -> FloatArray:
    if stress.shape == (3, 3):
        return stress
    xx, yy, zz, yz, xz, xy = stress
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])
