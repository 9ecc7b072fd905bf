"""Output files that never destroy data: staged names, refusal, resume, failures.

Every file a command writes is first written under a staged name next to it
(``relaxed.extxyz`` → ``relaxed.partial.extxyz``, ``md_00003.traj`` →
``md_00003.partial.traj``), structure by structure as results are computed,
and renamed to its final name only when the whole run has finished. A crash,
Ctrl-C or a killed job therefore leaves the results so far in the ``.partial``
files and any earlier output untouched, and ``--resume`` continues from them.
An output that already exists is replaced only with ``--overwrite``; an output
path that is also an input is always refused. With ``--resume`` an output of a
run that had already finished is taken up again (a copy is staged), so a job
script that always passes ``--resume`` succeeds on a requeue: the runner checks
the job identity of every result in it (:mod:`nvalchemi_ase.identity`) and,
with nothing left to compute, the same files are moved back into place.
"""

from __future__ import annotations

import csv
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from nvalchemi_ase.cli.common import CommandError

__all__ = ["PARTIAL", "OutputFiles", "partial_name", "write_failure_table"]

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
    resume : bool
        Keep the staged files of an interrupted run and continue them.
    """

    def __init__(
        self, inputs: Sequence[str], *, overwrite: bool, resume: bool = False
    ) -> None:
        self.overwrite = overwrite
        self.resume = resume
        self._inputs = {Path(name.partition("@")[0]).resolve(): name for name in inputs}
        self._claimed: list[Path] = []
        #: Finished outputs copied to their staged names (``--resume``).
        self._reopened: list[Path] = []

    def claim(self, path: Path | str) -> Path:
        """Register an output and return the staged path to write it to.

        Parameters
        ----------
        path : pathlib.Path or str
            Final output path.

        Returns
        -------
        pathlib.Path
            Its staged name (:func:`partial_name`); with ``resume`` a staged
            file of an interrupted run is kept to be continued, else with
            ``overwrite`` it is removed.

        Raises
        ------
        CommandError
            If the path (or its staged name) is an input, or exists and
            ``overwrite`` is False, or its staged name exists and neither
            ``resume`` nor ``overwrite`` is given.
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
        if self.resume and final.exists() and not staged.exists():
            self._reopen(final, staged)
        elif final.exists() and not self.overwrite:
            raise CommandError(
                f"{final} exists (an earlier run's output); pass --overwrite to "
                "replace it once the new results are complete, or choose another "
                "output"
            )
        if staged.exists() and not self.resume:
            if not self.overwrite:
                raise CommandError(
                    f"{staged} holds the results of an interrupted run; pass "
                    "--resume to continue it, --overwrite to discard it, or move "
                    "it away"
                )
            staged.unlink()
        self._claimed.append(final)
        return staged

    def _reopen(self, final: Path, staged: Path) -> None:
        """Stage a copy of a finished run's output, to be continued (requeue)."""
        if final.is_dir():
            raise CommandError(
                f"{final} is a directory; --resume takes up only files, pass "
                "--overwrite or choose another output"
            )
        shutil.copyfile(final, staged)
        self._reopened.append(final)

    @property
    def reopened(self) -> list[Path]:
        """Outputs of a finished run that ``--resume`` staged again (copied)."""
        return list(self._reopened)

    def discard_reopened(self) -> None:
        """Remove the staged copies of finished outputs this run left unchanged.

        Called when a run is refused (its inputs or model are another job's):
        the finished outputs stay as they were and no ``.partial`` file is
        left to be mistaken for an interrupted run.
        """
        for final in self._reopened:
            staged = partial_name(final)
            if staged.exists() and staged.stat().st_size == final.stat().st_size:
                staged.unlink()
        self._reopened.clear()

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


def write_failure_table(structures: Path, table: Path) -> int:
    """Write the CSV table of a run's failed structures; return how many.

    Parameters
    ----------
    structures : pathlib.Path
        The runner's failures file (extxyz; ``info`` ``source``, ``steps``,
        ``failure``); may be missing.
    table : pathlib.Path
        The CSV to write (:data:`FAILURE_COLUMNS`: input file, frame, step,
        reason), in input order; not written when nothing failed.

    Returns
    -------
    int
        Rows written.
    """
    from nvalchemi_ase.runners import read_results

    failed = read_results(structures, failures=False) if structures.exists() else []
    if not failed:
        table.unlink(missing_ok=True)
        return 0
    with table.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(FAILURE_COLUMNS)
        for atoms in failed:
            path, _, frame = str(atoms.info["source"]).rpartition("@")
            writer.writerow(
                (path, frame, int(atoms.info["steps"]), atoms.info["failure"])
            )
    return len(failed)
