"""``nvalchemi-ase relax``: relax every frame of every input, many at a time.

Runs :func:`nvalchemi_ase.runners.irelax`: a working batch sized from the
model's memory estimate and the memory free on the device; each structure
leaves it as soon as it has converged (or reached --steps, or failed) and the
next input takes its place. Inputs are read one frame at a time (once first,
to check every frame before any model call).

Writes one multi-frame extxyz in input order: relaxed positions (and cell with
``--cell``), energy (eV), forces (eV/Å), stress (eV/Å³, cells of rank 3), and in
``info``: ``converged`` (bool), ``steps`` (the structure's own optimizer
steps), ``index`` (input position) and ``source`` (``file@frame``).

A structure that fails (non-finite or exploding forces or steps) stops while
the others go on; it is left out of OUTPUT and written, in its last finite
state, to STEM.failed.extxyz, with a row (input file, frame, step, reason) in
STEM.failures.csv; the exit status is then 1.

Each structure is appended to NAME.partial.EXT as soon as it finishes (what
was computed before an error, Ctrl-C or a killed job stays there; --resume
continues from it), and the files are renamed to NAME.EXT when all structures
are done; existing outputs are replaced only with --overwrite, and an output
that is an input is refused.

Preemption: the working batch writes STEM.checkpoint.npz next to OUTPUT every
--checkpoint-every batch steps (default 100), atomically; it is removed once
every structure is written. SIGTERM or SIGINT stops the run at the next batch
step: the checkpoint of that step is written, every file flushed and closed,
one line says where the run stopped, and the exit status is 75. --restart
continues: finished structures are kept (as --resume) and the structures in
flight go on from the checkpoint, so the output and trajectories are those of
an uninterrupted run (a run killed without warning continues from its last
periodic checkpoint; structures it finished after that are not computed again).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from nvalchemi_ase.cli.outputs import OutputFiles

#: SIGTERM/SIGINT end the run cleanly (exit status 75; see cli.signals).
STOPS_ON_SIGNALS = True

__all__ = ["CELL_OPTIMIZERS", "OPTIMIZERS", "add_arguments", "run"]

OPTIMIZERS = ("FIRE", "FIRE2", "LBFGS", "BFGS")

#: Optimizers that relax cells: all of them (FIRE and BFGS follow ASE's path on
#: ASE's filter; FIRE2 and LBFGS run nvalchemi's variable-cell engines).
CELL_OPTIMIZERS = OPTIMIZERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``relax`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int
    from nvalchemi_ase.cli.runs import add_run_options

    parser.add_argument("files", nargs="+", help="structure files (globs, file@slice)")
    parser.add_argument(
        "--fmax",
        type=positive_float,
        default=0.05,
        help="convergence threshold on the largest force, eV/Å (default: 0.05)",
    )
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="FIRE", help="default: FIRE"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=1000,
        help="step limit of each structure (default: 1000)",
    )
    parser.add_argument(
        "--cell",
        action="store_true",
        help="relax the cell too (ASE's FrechetCellFilter; every optimizer: FIRE "
        "and BFGS follow ASE's path on it, FIRE2 and LBFGS run nvalchemi's "
        "variable-cell engines)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default="relaxed.extxyz",
        help="relaxed structures, input order (default: relaxed.extxyz); failed "
        "ones go to STEM.failed.extxyz and STEM.failures.csv next to it",
    )
    parser.add_argument(
        "--trajectories",
        metavar="DIR",
        default=None,
        help="also write one ASE trajectory per structure into DIR (NNNNN.traj, "
        "NNNNN the input position)",
    )
    parser.add_argument(
        "--plot",
        action="store_true",
        help="write STEM.png next to the output: energy and fmax of each "
        "structure against its own step (the structures relaxed by this run)",
    )
    add_run_options(parser)


def run(args: argparse.Namespace) -> int:
    """Relax all inputs through a refilled working batch; write and print results."""
    from ase.filters import FrechetCellFilter

    from nvalchemi_ase.cli.batching import labelled_atoms
    from nvalchemi_ase.cli.common import say
    from nvalchemi_ase.cli.runs import run_structures, staged_outputs
    from nvalchemi_ase.runners import irelax

    inputs, outputs = staged_outputs(args)
    output = Path(args.output)
    files = _Files(
        outputs,
        output,
        plot=args.plot,
        trajectories=args.trajectories,
        optimizer=args.optimizer,
    )  # before any work
    finished = run_structures(
        args,
        irelax,
        inputs,
        outputs,
        files,
        labelled_atoms,
        optimizer=args.optimizer,
        fmax=args.fmax,
        steps=args.steps,
        cell_filter=FrechetCellFilter if args.cell else None,
    )
    if finished is None:
        return 0  # not rank 0
    converged = _summary(args, output, files.failed_final)
    failed = finished.failed
    note = (
        f"; {failed} failed (see {files.failed_final}, {files.table_final})"
        if failed
        else ""
    )
    say(
        args,
        f"{converged}/{len(finished.inputs)} converged to fmax {args.fmax} eV/Å"
        f"{note}; wrote {output}",
    )
    return 1 if failed else 0


class _Files:
    """The staged outputs of a relaxation (claimed before any work)."""

    def __init__(
        self,
        outputs: OutputFiles,
        output: Path,
        *,
        plot: bool,
        trajectories: str | None = None,
        optimizer: str = "FIRE",
    ) -> None:
        self.optimizer = optimizer
        self.trajectories = trajectories
        self.failed_final = output.with_name(f"{output.stem}.failed.extxyz")
        self.table_final = output.with_name(f"{output.stem}.failures.csv")
        #: The working batch's checkpoint (not staged: removed by the runner).
        self.checkpoint = output.with_name(f"{output.stem}.checkpoint.npz")
        self.output = outputs.claim(output)
        self.failed = outputs.claim(self.failed_final)
        self.table = outputs.claim(self.table_final)
        self.plot = (
            outputs.claim(output.with_name(f"{output.stem}.png")) if plot else None
        )
        self.output.parent.mkdir(parents=True, exist_ok=True)

    def claim_trajectories(self, outputs: OutputFiles, count: int) -> str | None:
        """Claim one trajectory per input structure; the runner's staged template."""
        from nvalchemi_ase.cli.outputs import partial_name

        if not self.trajectories:
            return None
        folder = Path(self.trajectories)
        for index in range(count):
            outputs.claim(folder / f"{index:05d}.traj")
        folder.mkdir(parents=True, exist_ok=True)
        return str(partial_name(folder / "{i:05d}.traj"))

    def finish(self, series: dict[int, Any] | None, labels: Sequence[str]) -> int:
        """Sort the output into input order, write the table and plot; failures."""
        from nvalchemi_ase.cli.outputs import write_failure_table
        from nvalchemi_ase.runners import sort_output

        if self.output.exists():
            sort_output(self.output)
        if self.plot is not None and series:
            _plot(series, labels, self.plot, self.optimizer)
        return write_failure_table(self.failed, self.table)


def _plot(
    series: dict[int, Any], labels: Sequence[str], path: Path, optimizer: str
) -> None:
    """Energy and fmax of every structure relaxed, against its own step."""
    import numpy as np

    from nvalchemi_ase import plotting

    indices = sorted(series)
    length = max(len(series[i]["fmax"]) for i in indices)

    def padded(key: str) -> Any:
        # a structure that finished stays at its final value, as in a batch
        columns = [series[i][key] for i in indices]
        return np.stack(
            [np.pad(c, (0, length - len(c)), mode="edge") for c in columns], axis=1
        )

    arrays = {
        "step": np.arange(length),
        "epot_per_atom": padded("epot_per_atom"),
        "fmax": padded("fmax"),
    }
    names = [labels[i] for i in indices]
    plotting.plot_relaxation(
        arrays,
        path,
        title=f"{optimizer} relaxation ({len(indices)} structures)",
        labels=names,
    )


def _summary(args: argparse.Namespace, output: Path, failed: Path) -> int:
    """Print the table of every structure (input order); return how many converged."""
    from ase.io import iread

    from nvalchemi_ase.cli._table import RESULT_HEADER, format_table, result_row
    from nvalchemi_ase.cli.common import say

    if getattr(args, "quiet", False):
        return 0  # nothing is printed
    rows: dict[int, tuple[str, ...]] = {}
    for atoms in iread(output, index=":") if output.exists() else []:
        converged = bool(atoms.info["converged"])
        result = atoms.calc.results
        rows[int(atoms.info["index"])] = (
            *result_row(str(atoms.info["source"]), atoms, result),
            "yes" if converged else "NO",
        )
    converged_count = sum(row[-1] == "yes" for row in rows.values())
    if failed.exists():
        for atoms in iread(failed, index=":"):
            rows[int(atoms.info["index"])] = (
                str(atoms.info["source"]),
                atoms.get_chemical_formula(),
                str(len(atoms)),
                *(("-",) * 4),
                "FAILED",
            )
    say(
        args,
        format_table((*RESULT_HEADER, "converged"), [rows[k] for k in sorted(rows)]),
    )
    return converged_count
