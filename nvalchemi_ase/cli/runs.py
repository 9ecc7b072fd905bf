"""One command run, batch by batch: progress, errors naming frames, failures.

:class:`RunState` knows the batch and step a run has reached and where its
results so far are, so that Ctrl-C, an out-of-memory error or any other error
in a batch becomes one line naming the input frames (``file@frame``) instead
of positions inside the batch.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nvalchemi_ase.cli.batching import (
    BatchPlan,
    Chunk,
    is_out_of_memory,
    out_of_memory_message,
)
from nvalchemi_ase.cli.common import USER_ERRORS, CommandError
from nvalchemi_ase.cli.outputs import OutputFiles

__all__ = [
    "RunInterruptedError",
    "RunState",
    "StructureOutcome",
    "failed_structures",
    "quiet_failure_warnings",
    "report",
]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED_STATUS = 130


class RunInterruptedError(CommandError):
    """Ctrl-C during a run: printed as one line, exit status 130."""

    exit_status = INTERRUPTED_STATUS


@dataclass
class RunState:
    """Where a run is: for messages on interruption and errors.

    Attributes
    ----------
    outputs : OutputFiles
        The run's outputs (staged while it runs).
    plan : BatchPlan
        Its batches.
    chunk : Chunk or None
        The batch being computed.
    dynamics : object or None
        The dynamics object of that batch (its ``nsteps`` is the step reached).
    done : int
        Structures of earlier batches finished.
    """

    outputs: OutputFiles
    plan: BatchPlan
    chunk: Chunk | None = None
    dynamics: Any = None
    done: int = 0

    def progress(self) -> str:
        """E.g. ``"in batch 2/3 (in.xyz@4 to in.xyz@7, ...) at step 17"``."""
        if self.chunk is None:
            return "before the first batch" if not self.done else "between batches"
        text = f"in {self.chunk.describe()}"
        steps = getattr(self.dynamics, "nsteps", None)
        if steps is not None:
            text += f" at step {steps}"
        return text

    def interrupted(self) -> RunInterruptedError:
        """Return the one-line report of a Ctrl-C."""
        return RunInterruptedError(
            f"interrupted {self.progress()}; {self.done} structures finished, "
            f"{self.outputs.where()}"
        )

    @contextlib.contextmanager
    def batch(self, chunk: Chunk) -> Iterator[None]:
        """Run one batch; errors in it name the batch and its input frames.

        Parameters
        ----------
        chunk : Chunk
            The batch.

        Raises
        ------
        CommandError
            For an out-of-memory error (with a ``--max-atoms`` to use) or any
            user-facing error of the batch (naming ``file@frame``).
        """
        self.chunk, self.dynamics = chunk, None
        try:
            yield
        except KeyboardInterrupt:
            raise self.interrupted() from None
        except CommandError:
            raise
        except Exception as error:
            if is_out_of_memory(error):
                raise CommandError(
                    out_of_memory_message(chunk, self.plan, error, self.outputs.where())
                ) from error
            if not isinstance(error, USER_ERRORS):
                raise
            raise CommandError(
                f"{_blame(error, chunk)}: {_name_frames(str(error), chunk)}; "
                f"{self.outputs.where()}"
            ) from error
        self.done += len(chunk.items)
        self.chunk, self.dynamics = None, None


def _blame(error: BaseException, chunk: Chunk) -> str:
    """Name the frame an error is about (``error.index``), else the batch."""
    index = getattr(error, "index", None)
    if isinstance(index, int) and 0 <= index < len(chunk.items):
        return f"{chunk.items[index][1].label} ({chunk.describe()})"
    return chunk.describe()


def _name_frames(text: str, chunk: Chunk) -> str:
    """Replace ``images[i]`` and ``graph i`` (batch positions) by ``file@frame``."""

    def label(match: re.Match[str]) -> str:
        position = int(match.group(1))
        if 0 <= position < len(chunk.items):
            return chunk.items[position][1].label
        return match.group(0)

    text = re.sub(r"images\[(\d+)\]", label, text)
    return re.sub(r"\bgraph (\d+)\b", label, text)


# -- failed structures ------------------------------------------------------------


@dataclass(frozen=True)
class StructureOutcome:
    """Why one structure of a batch stopped.

    Attributes
    ----------
    position : int
        Its position in the batch.
    step : int
        The step at which it failed (0: the initial evaluation).
    reason : str
        What went wrong.
    """

    position: int
    step: int
    reason: str


def failed_structures(dynamics: Any) -> list[StructureOutcome]:
    """Return the structures a batched dynamics object isolated as failed.

    Parameters
    ----------
    dynamics : BatchedDynamics
        After its run; reads ``failures`` (index, step, reason).

    Returns
    -------
    list of StructureOutcome
        By position; empty when nothing failed.
    """
    outcomes = [
        StructureOutcome(int(f.index), int(f.step), str(f.reason))
        for f in dynamics.failures
    ]
    return sorted(outcomes, key=lambda outcome: outcome.position)


@contextlib.contextmanager
def quiet_failure_warnings() -> Iterator[None]:
    """Silence the dynamics' own per-failure warnings (they name batch positions).

    The CLI reports each failure itself, naming ``file@frame``.
    """
    from nvalchemi_ase.dynamics.failures import StructureFailedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructureFailedWarning)
        yield


def report(command: str, text: str) -> None:
    """Print one line to standard error (failures are shown even with --quiet)."""
    print(f"nvalchemi-ase {command}: {text}", file=sys.stderr)  # noqa: T201
