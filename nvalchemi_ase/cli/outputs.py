"""Output files that never destroy data: staged names, refusal, failures table.

Every file a command writes is first written under a staged name next to it
(``relaxed.extxyz`` → ``relaxed.partial.extxyz``, ``md_00003.traj`` →
``md_00003.partial.traj``), chunk by chunk as results are computed, and renamed
to its final name only when the whole run has finished. A crash or Ctrl-C
therefore leaves the results so far in the ``.partial`` files and any earlier
output untouched. An output that already exists is replaced only with
``--overwrite``; an output path that is also an input is always refused.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nvalchemi_ase.cli.common import CommandError, Source

__all__ = ["PARTIAL", "FailureLog", "OutputFiles", "partial_name"]

#: Marker inserted before the suffix of a file while it is being written.
PARTIAL = ".partial"

#: Columns of the failures table.
FAILURE_COLUMNS = ("input_file", "frame", "step", "reason")


def partial_name(path: Path) -> Path:
    """Return the staged name of ``path``: ``stem.partial.suffix`` next to it.

    Parameters
    ----------
    path : pathlib.Path
        Final output path.

    Returns
    -------
    pathlib.Path
        E.g. ``out/relaxed.partial.extxyz`` for ``out/relaxed.extxyz`` (the
        suffix is kept so ``ase.io.read`` still recognises the format).
    """
    return path.with_name(f"{path.stem}{PARTIAL}{path.suffix}")


class OutputFiles:
    """The outputs of one command run: checked, staged, then moved into place.

    Parameters
    ----------
    inputs : sequence of str
        Input files as given (``file@slice`` allowed), never to be written.
    overwrite : bool
        Whether an existing output may be replaced (at the end of the run).
    """

    def __init__(self, inputs: Sequence[str], *, overwrite: bool) -> None:
        self.overwrite = overwrite
        self._inputs = {Path(name.partition("@")[0]).resolve(): name for name in inputs}
        self._claimed: list[Path] = []

    def claim(self, path: Path | str) -> Path:
        """Register an output and return the staged path to write it to.

        Parameters
        ----------
        path : pathlib.Path or str
            Final output path.

        Returns
        -------
        pathlib.Path
            Its staged name (:func:`partial_name`); with ``overwrite``, a stale
            staged file from an interrupted run is removed.

        Raises
        ------
        CommandError
            If the path (or its staged name) is an input, or exists and
            ``overwrite`` is False.
        """
        final = Path(path)
        staged = partial_name(final)
        for candidate in (final, staged):
            source = self._inputs.get(candidate.resolve())
            if source is not None:
                raise CommandError(
                    f"output {candidate} is the input {source}: writing it would "
                    "destroy the input; choose another output name"
                )
        if not self.overwrite:
            if final.exists():
                raise CommandError(
                    f"{final} exists (an earlier run's output); pass --overwrite to "
                    "replace it once the new results are complete, or choose another "
                    "output"
                )
            if staged.exists():
                raise CommandError(
                    f"{staged} holds the results of an interrupted run; move it "
                    "away, or pass --overwrite to discard it"
                )
        elif staged.exists():
            staged.unlink()
        self._claimed.append(final)
        return staged

    def staged(self) -> list[Path]:
        """Staged files written so far (results of an unfinished run).

        Returns
        -------
        list of pathlib.Path
            In the order they were claimed.
        """
        return [partial_name(p) for p in self._claimed if partial_name(p).exists()]

    def where(self) -> str:
        """Where the results so far are, for a one-line message.

        Returns
        -------
        str
            E.g. ``"results so far in out.partial.extxyz"`` (with a count of the
            other staged files), or ``"no results were written"``.
        """
        staged = self.staged()
        if not staged:
            return "no results were written"
        others = len(staged) - 1
        more = f" (and {others} more *{PARTIAL}.* files there)" if others else ""
        return f"results so far in {staged[0]}{more}"

    def commit(self) -> None:
        """Move every staged file to its final name (the run has finished).

        A claimed output this run did not produce (e.g. a failures file when
        nothing failed) is removed if an earlier run left one, so the outputs
        all belong to this run; that can only happen with ``overwrite``.
        """
        for final in self._claimed:
            staged = partial_name(final)
            if staged.exists():
                os.replace(staged, final)
            elif final.exists():
                final.unlink()


class FailureLog:
    """Structures that failed: their last finite state and a CSV table.

    Parameters
    ----------
    outputs : OutputFiles
        Where the two files are claimed.
    structures : pathlib.Path
        Final path of the extxyz of failed structures (last finite state,
        ``info``: ``source``, ``failed_step``, ``failure``).
    table : pathlib.Path
        Final path of the CSV table (:data:`FAILURE_COLUMNS`).
    """

    def __init__(self, outputs: OutputFiles, structures: Path, table: Path) -> None:
        self.structures = structures
        self.table = table
        self._structures_staged = outputs.claim(structures)
        self._table_staged = outputs.claim(table)
        self.count = 0

    def record(self, source: Source, atoms: Any, step: int, reason: str) -> None:
        """Write one failed structure and its table row (flushed at once).

        Parameters
        ----------
        source : Source
            Where it came from.
        atoms : ase.Atoms
            Its last finite state (written without calculator results).
        step : int
            Step at which it failed (0: the initial evaluation).
        reason : str
            What went wrong.
        """
        from ase.io import write

        frame = atoms.copy()
        frame.calc = None
        frame.info.update(source=source.label, failed_step=int(step), failure=reason)
        write(self._structures_staged, frame, format="extxyz", append=True)
        new = not self._table_staged.exists()
        with self._table_staged.open("a", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            if new:
                writer.writerow(FAILURE_COLUMNS)
            writer.writerow((source.path, source.frame, int(step), reason))
        self.count += 1
