"""The MD chunk in flight: its checkpoint (``restart=``) and a stop at a step boundary.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["INDICES_TAG", "ChunkRestart", "RunStopped"]

#: Checkpoint tag (``extra/tag/<name>``) holding the chunk's input indices.
INDICES_TAG = "input_indices"


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


def _span(indices: Sequence[int]) -> str:
    """Describe input indices for a message: ``inputs 4-7``, or their list."""
    values = [int(i) for i in indices]
    if values and values == list(range(values[0], values[0] + len(values))):
        return f"inputs {values[0]}-{values[-1]}"
    return f"inputs {values}"
