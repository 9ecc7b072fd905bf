"""Read the trajectories ``replay_trajectory`` rebuilds an optimizer's memory from.

ASE's ``BFGS.replay_trajectory(traj)`` (and ``LBFGS``'s) takes one trajectory
(a path or an open ``Trajectory``) and feeds its frames' positions and forces to
the optimizer's update, so that a relaxation continued from the last frame
starts with the Hessian it had. A batched optimizer takes one trajectory per
structure: a ``{i}`` template, a sequence (paths, ``Trajectory`` objects or
lists of ``Atoms``), or, for one structure, a single one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from ase import Atoms

from nvalchemi_ase.dynamics.logs import is_template

__all__ = ["frame_arrays", "replay_frames"]


def replay_frames(traj: Any, images: Sequence[Atoms]) -> list[list[Atoms]]:
    """Every structure's frames (positions and forces) from its trajectory.

    Parameters
    ----------
    traj : str, path, Trajectory, sequence of Atoms, or a sequence of those
        One trajectory per structure (a ``{i}`` template, or a list in the
        order of ``images``); one structure may give one trajectory.
    images : sequence of ase.Atoms
        The optimizer's structures, to check atom counts and numbers.

    Returns
    -------
    list of list of ase.Atoms
        Per structure, its frames in order (each with forces).

    Raises
    ------
    ValueError
        If the number of trajectories differs from the number of structures,
        a frame has other atoms than its structure, or carries no forces.
    """
    count = len(images)
    if is_template(traj):
        sources: list[Any] = [traj.format(i=index) for index in range(count)]
    elif _is_one_trajectory(traj):
        sources = [traj]
    else:
        sources = list(traj)
    if len(sources) != count:
        raise ValueError(
            f"replay_trajectory got {len(sources)} trajectories for {count} "
            "structures; give one per structure (a '{i}' template or a list)"
        )
    frames = [_read(source) for source in sources]
    for index, (atoms, trajectory) in enumerate(zip(images, frames, strict=True)):
        for number, frame in enumerate(trajectory):
            if len(frame) != len(atoms) or not np.array_equal(
                frame.numbers, atoms.numbers
            ):
                raise ValueError(
                    f"replay_trajectory: frame {number} of images[{index}]'s "
                    "trajectory has other atoms than images[index]"
                )
            if frame.calc is None or "forces" not in frame.calc.results:
                raise ValueError(
                    f"replay_trajectory: frame {number} of images[{index}]'s "
                    "trajectory has no forces (write trajectories from the "
                    "optimizer, which stores them)"
                )
    return frames


def frame_arrays(
    frames: list[list[Atoms]], number: int, images: Sequence[Atoms]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Frame ``number`` of every structure: positions (Å) and forces (eV/Å), (V, 3).

    Structures whose trajectory is shorter get zeros (the caller leaves them
    alone).
    """
    positions, forces = [], []
    for trajectory, atoms in zip(frames, images, strict=True):
        if number < len(trajectory):
            positions.append(trajectory[number].get_positions())
            forces.append(trajectory[number].get_forces())
        else:
            positions.append(np.zeros((len(atoms), 3)))
            forces.append(np.zeros((len(atoms), 3)))
    return np.concatenate(positions), np.concatenate(forces)


def _is_one_trajectory(traj: Any) -> bool:
    if isinstance(traj, str | os.PathLike):
        return True
    if isinstance(traj, Sequence) and traj and isinstance(traj[0], Atoms):
        return True  # a list of frames
    from ase.io.trajectory import TrajectoryReader

    return isinstance(traj, TrajectoryReader)


def _read(source: Any) -> list[Atoms]:
    if isinstance(source, str | os.PathLike):
        from ase.io.trajectory import Trajectory

        with Trajectory(source, "r") as reader:
            return list(reader)
    return list(source)
