"""The work in flight: its checkpoint (``restart=``) and a stop at a step boundary.

MD (:class:`ChunkRestart`)
--------------------------

:func:`~nvalchemi_ase.runners.imd` with ``restart=PATH`` has the chunk in
flight write ``PATH`` (the format of :mod:`nvalchemi_ase.dynamics.checkpoint`,
atomically) every ``restart_interval`` steps, at the end of its run and when
``stop()`` asks for a stop; ``PATH`` is removed once every result of that
chunk is in ``output`` (so a file left behind never protects anything already
written). If ``PATH`` exists when the run starts, the run continues, as ASE's
``restart=`` does: ``resume=True`` is implied, and the first chunk not fully
written continues from the checkpoint instead of being run again from its
start (its trajectories appended to, frames written after the checkpoint cut),
so its numbers and frames are those of the uninterrupted run.

Each checkpoint carries the input indices of its chunk (``extra/tag/``
:data:`INDICES_TAG`). A file whose chunk was written in full (the run was
killed between writing the results and removing the file) is removed and the
next chunk starts afresh; a file written for another chunk (other inputs or
other batching options) or not by a runner is refused with a
:class:`~nvalchemi_ase.dynamics.checkpoint.CheckpointError`.

Relaxation (:class:`WorkingBatchRestart`)
-----------------------------------------
:func:`~nvalchemi_ase.runners.irelax` with ``restart=PATH`` writes the
optimizer's checkpoint of its whole working batch (structures that finished
and wait for the next refill included) every ``restart_interval`` batch steps
and when ``stop()`` asks for a stop, with the runner's own bookkeeping as tags:
the input index, own step count, finished flag, trajectory frame count and
plot series of every structure in it. The file is written only between
refills, when the batch is exactly what the next step will run, and removed
once every structure is written. A run that finds ``PATH`` continues
(``resume=True`` implied): the structures of the checkpoint are taken from the
inputs again (by index), the optimizer continues from the file (the
dynamics classes' exact ``restart=``: engine state, neighbour lists,
counters), each structure's trajectory is cut back to the frames the
checkpoint counted and appended to, and the refills go on from there. So a run
stopped by ``stop()`` and continued ends bit for bit as the uninterrupted run.
After a kill, structures that finished after the last checkpoint are already
in ``output``: they are dropped at the first refill and not written again, and
the batch goes on without them (every structure's path is its own, so the
others end as they would have; with models whose batched sums depend on the
batch's composition, to rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.runners.distributed import Shard, shard_files, shard_path

__all__ = [
    "IDENTITY_TAG",
    "INDICES_TAG",
    "ChunkRestart",
    "RunStopped",
    "WorkingBatchRestart",
    "checkpoint_exists",
    "rank_path",
]

#: Checkpoint tag (``extra/tag/<name>``) holding the chunk's input indices.
INDICES_TAG = "input_indices"
#: Relaxation tags: each structure's own steps, finished flag, trajectory
#: frames (-1: none) and plot series ((E/atom, fmax) rows, concatenated, with
#: their lengths; -1: none).
STEPS_TAG = "steps"
FINISHED_TAG = "finished"
#: The refill policy's frozen-atom account since the batch was built (a float).
IDLE_TAG = "idle"
FRAMES_TAG = "trajectory_frames"
#: Digests of each structure's input as given (:mod:`nvalchemi_ase.identity`).
IDENTITY_TAG = "input_identity"
SERIES_TAG = "series"
SERIES_LENGTHS_TAG = "series_lengths"
_WORKING_BATCH_TAGS = (INDICES_TAG, STEPS_TAG, FINISHED_TAG, FRAMES_TAG)


class RunStopped(Exception):  # noqa: N818 (a stop asked for, not an error)
    """A run stopped at a step boundary because its ``stop()`` returned True.

    Attributes
    ----------
    step : int or None
        Steps the chunk in flight had taken (None: stopped between chunks).
    checkpoint : pathlib.Path or None
        The checkpoint written at that step (None without ``restart=``, or
        between chunks, when there is nothing in flight to keep).
    input_indices : tuple of int
        The input indices of the chunk in flight (empty between chunks).
    """

    def __init__(
        self,
        step: int | None,
        checkpoint: Path | None,
        input_indices: Sequence[int] = (),
    ) -> None:
        where = "between chunks" if step is None else f"at step {step}"
        super().__init__(f"stopped {where}")
        self.step = step
        self.checkpoint = checkpoint
        self.input_indices = tuple(int(i) for i in input_indices)


@dataclass(frozen=True)
class ChunkRestart:
    """The checkpoint file of the chunk in flight.

    Attributes
    ----------
    path : pathlib.Path
        The file (its directory is created when the first chunk runs).
    interval : int or None
        Steps between periodic writes (None: the dynamics classes' default,
        :data:`~nvalchemi_ase.dynamics.checkpoint.DEFAULT_RESTART_INTERVAL`).
    """

    path: Path
    interval: int | None = None

    def exists(self) -> bool:
        """Whether a checkpoint is there to continue from."""
        return self.path.exists()

    def continues(self, indices: Sequence[int], done: set[int]) -> bool:
        """Whether the chunk of ``indices`` continues from the file.

        Parameters
        ----------
        indices : sequence of int
            Input indices of the chunk's structures, in batch order.
        done : set of int
            Input indices whose results are already written.

        Returns
        -------
        bool
            True if the file exists and was written for this chunk; False if
            there is none (or it was a finished chunk's, now removed).

        Raises
        ------
        CheckpointError
            If the file belongs to another chunk that is not finished, or was
            not written by a runner.
        """
        from nvalchemi_ase.dynamics.checkpoint import CheckpointError, read_checkpoint

        if not self.path.exists():
            return False
        saved = read_checkpoint(self.path).arrays.get(f"extra/tag/{INDICES_TAG}")
        if saved is None:
            raise CheckpointError(
                f"restart file {self.path} was not written by a runner (it has no "
                f"'extra/tag/{INDICES_TAG}' entry naming its structures); remove it "
                "or give another restart path"
            )
        chunk = [int(i) for i in saved.reshape(-1)]
        if chunk == [int(i) for i in indices]:
            return True
        if all(index in done for index in chunk):
            self.written()  # killed after that chunk's results, before the removal
            return False
        raise CheckpointError(
            f"restart file {self.path}: field 'extra/tag/{INDICES_TAG}' is "
            f"{_span(chunk)} in the checkpoint but the chunk in flight is "
            f"{_span(indices)} here (other inputs, or other batching options: "
            "--batch-size, --max-atoms); continue with the inputs and options of "
            "the interrupted run, or remove the file to run that chunk again "
            "from its start"
        )

    def arguments(self, continuing: bool) -> dict[str, Any]:
        """Keywords of the MD class for the chunk (``restart=``, trajectories)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return {
            "restart": self.path,
            "restart_interval": self.interval,
            "append_trajectory": continuing,
        }

    @staticmethod
    def tags(indices: Sequence[int]) -> dict[str, npt.NDArray[Any]]:
        """Return the ``checkpoint_tags`` naming the chunk of ``indices``."""
        return {INDICES_TAG: np.asarray(indices, dtype=np.int64)}

    def written(self) -> None:
        """Remove the file: its chunk's results are all written."""
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class WorkingBatchRestart:
    """The checkpoint file of the relaxation runner's working batch.

    Attributes
    ----------
    path : pathlib.Path
        The file (its directory is created at the first write).
    interval : int or None
        Batch steps between periodic writes (None: the dynamics classes'
        default, :data:`~nvalchemi_ase.dynamics.checkpoint.DEFAULT_RESTART_INTERVAL`).
    """

    path: Path
    interval: int | None = None

    @property
    def every(self) -> int:
        """Batch steps between periodic writes."""
        from nvalchemi_ase.dynamics.checkpoint import DEFAULT_RESTART_INTERVAL

        interval = DEFAULT_RESTART_INTERVAL if self.interval is None else self.interval
        if interval < 1:
            raise ValueError(f"restart_interval must be >= 1 (steps), got {interval}")
        return int(interval)

    def exists(self) -> bool:
        """Whether a checkpoint is there to continue from."""
        return self.path.exists()

    def tags(self) -> dict[str, npt.NDArray[Any]]:
        """Read the runner's tags of the saved working batch.

        Returns
        -------
        dict of numpy.ndarray
            :data:`INDICES_TAG`, :data:`STEPS_TAG`, :data:`FINISHED_TAG`,
            :data:`FRAMES_TAG` (each (B,)) and, when a series was kept,
            :data:`SERIES_TAG` (rows, 2) and :data:`SERIES_LENGTHS_TAG` (B,).

        Raises
        ------
        CheckpointError
            If the file is damaged, or was not written by a relaxation runner.
        """
        from nvalchemi_ase.dynamics.checkpoint import CheckpointError, read_checkpoint

        saved = read_checkpoint(self.path).group("extra")
        tags = {
            key.removeprefix("tag/"): value
            for key, value in saved.items()
            if key.startswith("tag/")
        }
        missing = [name for name in _WORKING_BATCH_TAGS if name not in tags]
        if missing:
            raise CheckpointError(
                f"restart file {self.path} was not written by a relaxation runner "
                f"(it has no 'extra/tag/{missing[0]}' entry); remove it or give "
                "another restart path"
            )
        return tags

    def write(self, opt: Any, tags: dict[str, npt.NDArray[Any]]) -> None:
        """Write ``opt``'s checkpoint with the runner's ``tags`` (atomically)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        opt.checkpoint_tags = tags
        opt.write_checkpoint(self.path)

    def written(self) -> None:
        """Remove the file: every structure it held is written."""
        self.path.unlink(missing_ok=True)


def checkpoint_exists(restart: str | Path | None) -> bool:
    """Whether a checkpoint (of any rank) is there to continue from."""
    return restart is not None and (
        Path(restart).exists() or bool(shard_files(restart))
    )


def rank_path(path: str | Path, shard: Shard) -> Path:
    """Return this rank's file: ``path`` on rank 0, ``stem.rank1.suffix`` on rank 1."""
    return shard_path(path, shard.rank) if shard.rank else Path(path)


def _span(indices: Sequence[int]) -> str:
    """Describe input indices for a message: ``inputs 4-7``, or their list."""
    values = [int(i) for i in indices]
    if values and values == list(range(values[0], values[0] + len(values))):
        return f"inputs {values[0]}-{values[-1]}"
    return f"inputs {values}"
