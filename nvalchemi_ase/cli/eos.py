"""``nvalchemi-ase eos``: equations of state of every input structure, batched.

Every frame of every input is a material. Each is scaled to --n-volumes cells
(lattice vectors times 1 - STRAIN ... 1 + STRAIN); all scaled cells of all
materials are evaluated in batched model calls, or with --relax ions their
ions are first relaxed at fixed cell in one in-flight run (each cell leaves
the working batch as it converges). ASE's
EquationOfState fits E(V): V0 in Å³, E0 in eV, B in GPa.

Outputs: every name below is put after --file-prefix (a directory ending in
"/", default nvalchemi-ase-results/, or a path stem joined with "-"), and
<material> is the input file's stem, plus "-FRAME" for multi-frame files:
<material>-eos.json (points, fit, units), <material>-eos.extxyz (every
scaled cell with its energy: ase gui's Tools > Bulk modulus reads it),
<material>-eos.png (E(V) and the fit; not with --no-plot), eos-results.csv
(one row per material) and eos-summary.json (inputs, options, outputs,
timings, failures). A material that fails is listed with its reason, the
others finish, and the exit status is 1.
Files are written as NAME.partial.EXT and renamed when the run completes;
existing outputs are replaced only with --overwrite.

This module also holds what the property commands (eos, elastic, phonons,
qha, kappa, surface, defect) share: options, output naming, the summary and the
run itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi_ase.cli.common import Source
    from nvalchemi_ase.properties.eos import EOSResult

__all__ = [
    "DEFAULT_PREFIX",
    "PropertyCommand",
    "add_arguments",
    "add_optimizer_arguments",
    "add_phonopy_arguments",
    "add_property_arguments",
    "add_relaxation_arguments",
    "add_relaxation_limits",
    "add_supercell_argument",
    "material_names",
    "output_path",
    "run",
    "run_property_command",
    "supercell_value",
]

#: Where results go unless --file-prefix says otherwise.
DEFAULT_PREFIX = "nvalchemi-ase-results/"


# -- shared by the property commands ------------------------------------------


def add_relaxation_arguments(
    parser: argparse.ArgumentParser, *, default_fmax: float
) -> None:
    """Register ``--relax-first``, ``--fmax``, ``--steps`` and the optimizers.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    default_fmax : float
        Default force threshold of the relaxations, eV/Å.
    """
    parser.add_argument(
        "--relax-first",
        action="store_true",
        help="relax cell and ions of every material first (FrechetCellFilter)",
    )
    add_relaxation_limits(parser, default_fmax=default_fmax)
    add_optimizer_arguments(parser, cell="--relax-first")


def add_relaxation_limits(
    parser: argparse.ArgumentParser,
    *,
    default_fmax: float,
    relaxations: str = "the relaxations",
    each: str = "each batched relaxation",
) -> None:
    """Register ``--fmax`` (eV/Å) and ``--steps`` (default 1000).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    default_fmax : float
        Default force threshold, eV/Å.
    relaxations, each : str
        What the help calls the relaxations (``--fmax``) and one of them
        (``--steps``).
    """
    from nvalchemi_ase.cli.common import positive_float, positive_int

    parser.add_argument(
        "--fmax",
        type=positive_float,
        default=default_fmax,
        help=f"force threshold of {relaxations}, eV/Å (default: {default_fmax:g})",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=1000,
        help=f"step limit of {each} (default: 1000)",
    )


def add_optimizer_arguments(
    parser: argparse.ArgumentParser, *, cell: str, ions: bool = True
) -> None:
    """Register ``--optimizer`` (with ``ions``) and ``--cell-optimizer``.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    cell : str
        The relaxation the cell optimizer runs, as the help names it.
    ions : bool
        Whether the command relaxes ions at fixed cell too (``--optimizer``).
    """
    from nvalchemi_ase.properties._common import (
        FIXED_CELL_OPTIMIZERS,
        VARIABLE_CELL_OPTIMIZERS,
    )

    if ions:
        parser.add_argument(
            "--optimizer",
            choices=FIXED_CELL_OPTIMIZERS,
            default="FIRE",
            help="ion optimizer (default: FIRE)",
        )
    parser.add_argument(
        "--cell-optimizer",
        choices=VARIABLE_CELL_OPTIMIZERS,
        default="FIRE2",
        help=f"optimizer of {cell} (default: FIRE2)",
    )


def add_phonopy_arguments(
    parser: argparse.ArgumentParser,
    *,
    displacement: float,
    mesh: list[int],
    mesh_help: str,
) -> None:
    """Register ``--displacement``, ``--mesh`` and ``--primitive`` (phonopy's).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    displacement : float
        Default displacement amplitude, Å.
    mesh : list of int
        Default q-mesh (3 integers).
    mesh_help : str
        What the mesh is for; the help adds the default after it.
    """
    from nvalchemi_ase.cli.common import positive_float, positive_int

    parser.add_argument(
        "--displacement",
        type=positive_float,
        default=displacement,
        help=f"displacement amplitude, Å (default: {displacement:g})",
    )
    parser.add_argument(
        "--mesh",
        type=positive_int,
        nargs=3,
        default=mesh,
        metavar="N",
        help=mesh_help.format(default=" ".join(map(str, mesh))),
    )
    parser.add_argument(
        "--primitive",
        choices=("auto", "P"),
        default="auto",
        help="primitive cell: found by symmetry (auto) or the input cell (P)",
    )


def add_supercell_argument(
    parser: argparse.ArgumentParser, name: str, default: list[int] | None, what: str
) -> None:
    """Register a ``--supercell``-like option of 1, 3 or 9 integers."""
    parser.add_argument(
        name,
        type=int,
        nargs="+",
        default=default,
        metavar="N",
        help=f"{what}: 1, 3 or 9 integers"
        + (f" (default: {' '.join(map(str, default))})" if default else ""),
    )


def supercell_value(values: list[int] | None, option: str) -> Any:
    """1, 3 or 9 integers as phonopy's supercell; None stays None.

    Raises
    ------
    CommandError
        If there are not 1, 3 or 9 integers (naming ``option``).
    """
    import numpy as np

    from nvalchemi_ase.cli.common import CommandError

    if values is None:
        return None
    if len(values) not in (1, 3, 9):
        raise CommandError(f"{option} takes 1, 3 or 9 integers, got {len(values)}")
    array = np.array(values)
    if array.size == 1:
        return int(array[0])
    return array.reshape(3, 3) if array.size == 9 else array


def add_property_arguments(parser: argparse.ArgumentParser, *, plots: bool) -> None:
    """Add inputs, ``--file-prefix``, ``--overwrite``, ``--quiet``, model options.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    plots : bool
        Whether the command draws plots (adds ``--no-plot``).
    """
    from nvalchemi_ase.cli.common import add_model_options, add_overwrite_option

    parser.add_argument(
        "files",
        nargs="+",
        help="structure files (globs, file@slice); one material per frame",
    )
    parser.add_argument(
        "--file-prefix",
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help="prefix of every output: a directory ending in '/' or a path stem "
        f"(e.g. out/run1 gives out/run1-Si-...); default: {DEFAULT_PREFIX}",
    )
    if plots:
        parser.add_argument(
            "--no-plot", action="store_true", help="do not write PNG plots"
        )
    add_overwrite_option(parser)
    parser.add_argument(
        "--quiet", action="store_true", help="no table on standard output"
    )
    add_model_options(parser)


def output_path(prefix: str, *parts: str) -> Path:
    """Join an output name onto ``--file-prefix`` as janus-core does.

    Parameters
    ----------
    prefix : str
        A directory (ending in ``/``) or a path stem.
    *parts : str
        Name parts, joined with ``-`` (the last one carries the extension).

    Returns
    -------
    pathlib.Path
        ``prefix + "-".join(parts)`` for a directory, else
        ``prefix + "-" + "-".join(parts)``.
    """
    name = "-".join(parts)
    if prefix.endswith(("/", "\\")) or Path(prefix).is_dir():
        return Path(prefix) / name
    return Path(f"{prefix}-{name}")


def material_names(sources: Sequence[Source]) -> list[str]:
    """Give every material a file-name-safe, unique name.

    Parameters
    ----------
    sources : sequence of Source
        The inputs.

    Returns
    -------
    list of str
        The file's stem, plus ``-FRAME`` when the file holds several of the
        selected frames; ``-2``, ``-3``, ... resolve clashes.
    """
    frames_per_file: dict[str, int] = {}
    for source in sources:
        frames_per_file[source.path] = frames_per_file.get(source.path, 0) + 1
    names: list[str] = []
    seen: set[str] = set()
    for source in sources:
        stem = "".join(
            c if c.isalnum() or c in "._+" else "_" for c in Path(source.path).stem
        )
        name = f"{stem}-{source.frame}" if frames_per_file[source.path] > 1 else stem
        unique, count = name, 1
        while unique in seen:
            count += 1
            unique = f"{name}-{count}"
        seen.add(unique)
        names.append(unique)
    return names


@dataclass
class PropertyCommand:
    """What differs between the property commands.

    Attributes
    ----------
    name : str
        The subcommand (``"eos"``), also the suffix of its output files.
    compute : callable
        ``(args, calc, atoms_list) -> list of MaterialResult``.
    header : tuple of str
        Table columns (after material, source, formula, atoms and status).
    row : callable
        ``(result) -> tuple of str`` for those columns.
    extras : dict
        Per-material files besides the JSON: suffix (``"eos.png"``) ->
        ``(args, result, staged_path) -> None``, called for computed materials
        (and only if ``wanted(args)``).
    wanted : callable
        ``(args, suffix) -> bool``: whether that extra file is written.
    json_drop : tuple of str
        Result fields left out of the JSON (written in another form).
    """

    name: str
    compute: Callable[[argparse.Namespace, Any, list[Any]], list[Any]]
    header: tuple[str, ...]
    row: Callable[[Any], tuple[str, ...]]
    extras: dict[str, Callable[[argparse.Namespace, Any, Path], None]] = field(
        default_factory=dict
    )
    wanted: Callable[[argparse.Namespace, str], bool] = lambda args, suffix: True
    json_drop: tuple[str, ...] = ()


def run_property_command(args: argparse.Namespace, command: PropertyCommand) -> int:
    """Read the inputs, compute every material in one batched workflow, write.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed options (``files``, ``file_prefix``, ``overwrite``, ``quiet``,
        model options and the command's own).
    command : PropertyCommand
        What to compute and write.

    Returns
    -------
    int
        0 when every material was computed, 1 when some failed.
    """
    from nvalchemi_ase.cli.common import build_calculator, expand_inputs, read_paths
    from nvalchemi_ase.cli.outputs import OutputFiles

    started = datetime.datetime.now(datetime.UTC)
    clock = time.perf_counter()
    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    calc = build_calculator(args)  # configuration errors before reading
    sources = read_paths(inputs)
    names = material_names(sources)
    prefix = args.file_prefix
    table_path = output_path(prefix, f"{command.name}-results.csv")
    summary_path = output_path(prefix, f"{command.name}-summary.json")
    suffixes = [f"{command.name}.json"] + [
        suffix for suffix in command.extras if command.wanted(args, suffix)
    ]
    finals = {
        (k, suffix): output_path(prefix, name, suffix)
        for k, name in enumerate(names)
        for suffix in suffixes
    }
    staged = {key: outputs.claim(path) for key, path in finals.items()}
    staged_table = outputs.claim(table_path)
    staged_summary = outputs.claim(summary_path)
    read_s = time.perf_counter() - clock
    clock = time.perf_counter()
    results = command.compute(args, calc, [source.atoms for source in sources])
    compute_s = time.perf_counter() - clock
    clock = time.perf_counter()
    rows = []
    for k, (source, name, result) in enumerate(
        zip(sources, names, results, strict=True)
    ):
        _write_material(args, command, source, name, result, staged, k)
        rows.append(_row(command, source, name, result))
    header = ("material", "source", "formula", "atoms", "status", *command.header)
    _write_csv(staged_table, header, rows)
    failures = [
        (name, result.error)
        for name, result in zip(names, results, strict=True)
        if not result.ok
    ]
    written = sorted(
        {str(finals[key]) for key, path in staged.items() if path.exists()}
        | {str(table_path), str(summary_path)}
    )
    timings = {
        "read_s": read_s,
        "compute_s": compute_s,
        "write_s": time.perf_counter() - clock,
    }
    summary = _summary(
        args, command, calc, sources, names, results, written, started, timings
    )
    _write_json(staged_summary, summary)
    outputs.commit()
    _report(args, command, header, rows, failures, summary, table_path)
    return 1 if failures else 0


def _write_material(
    args: argparse.Namespace,
    command: PropertyCommand,
    source: Source,
    name: str,
    result: Any,
    staged: dict[tuple[int, str], Path],
    index: int,
) -> None:
    data = {"material": name, "source": source.label, **result.to_dict()}
    for key in command.json_drop:
        data.pop(key, None)
    _write_json(staged[(index, f"{command.name}.json")], data)
    if not result.ok:
        return
    for suffix, write in command.extras.items():
        if (index, suffix) in staged:
            write(args, result, staged[(index, suffix)])


def _row(
    command: PropertyCommand, source: Source, name: str, result: Any
) -> tuple[str, ...]:
    head = (name, source.label, result.formula, str(result.natoms))
    if not result.ok:
        return (*head, "FAILED", *("-" for _ in command.header))
    return (*head, "ok", *command.row(result))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(data, indent=2, allow_nan=False, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )


def _write_csv(path: Path, header: Sequence[str], rows: list[tuple[str, ...]]) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def _summary(
    args: argparse.Namespace,
    command: PropertyCommand,
    calc: Any,
    sources: Sequence[Source],
    names: list[str],
    results: list[Any],
    written: list[str],
    started: datetime.datetime,
    timings: dict[str, float],
) -> dict[str, Any]:
    """Describe the run: inputs, options, outputs, timings (janus-core's summary)."""
    from nvalchemi_ase import __version__

    options = {
        key: value
        for key, value in vars(args).items()
        if not key.startswith("_")
        and key not in ("files", "run_state")
        and isinstance(value, str | int | float | bool | type(None) | list | tuple)
    }
    ended = datetime.datetime.now(datetime.UTC)
    return {
        "command": f"nvalchemi-ase {command.name}",
        "version": __version__,
        "start_time": started.isoformat(),
        "end_time": ended.isoformat(),
        "model": {
            "spec": args.model,
            "class": type(calc.model).__name__,
            "device": str(calc.device),
            "dtype": str(calc.dtype).removeprefix("torch."),
        },
        "options": options,
        "inputs": [
            {
                "material": name,
                "source": source.label,
                "formula": source.atoms.get_chemical_formula(),
                "atoms": len(source.atoms),
            }
            for source, name in zip(sources, names, strict=True)
        ],
        "outputs": written,
        "timings": {**timings, "total_s": (ended - started).total_seconds()},
        "materials": len(results),
        "failed": [
            {"material": name, "reason": result.error}
            for name, result in zip(names, results, strict=True)
            if not result.ok
        ],
    }


def _report(
    args: argparse.Namespace,
    command: PropertyCommand,
    header: Sequence[str],
    rows: list[tuple[str, ...]],
    failures: list[tuple[str, str]],
    summary: dict[str, Any],
    table_path: Path,
) -> None:
    from nvalchemi_ase.cli._table import format_table
    from nvalchemi_ase.cli.common import say
    from nvalchemi_ase.cli.runs import report

    say(args, format_table(header, rows))
    for name, reason in failures:
        report(command.name, f"{name} failed: {reason}")
    timings = summary["timings"]
    say(
        args,
        f"{len(rows) - len(failures)}/{len(rows)} materials computed in "
        f"{timings['compute_s']:.1f} s (total {timings['total_s']:.1f} s); wrote "
        f"{table_path} and {len(summary['outputs']) - 1} more files",
    )


# -- eos ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``eos`` options."""
    from ase.eos import eos_names

    from nvalchemi_ase.cli.common import positive_float, positive_int

    parser.add_argument(
        "--n-volumes",
        type=positive_int,
        default=7,
        help="volumes per material (default: 7, at least 5)",
    )
    parser.add_argument(
        "--strain",
        type=positive_float,
        default=0.05,
        help="largest linear strain, ± (default: 0.05: lattice x 0.95 ... 1.05)",
    )
    parser.add_argument(
        "--eos",
        choices=eos_names,
        default="birchmurnaghan",
        help="ASE's EOS form (default: birchmurnaghan)",
    )
    parser.add_argument(
        "--relax",
        choices=("none", "ions", "shape"),
        default="none",
        help="relax at each volume: none (single points), ions (fixed cell), "
        "shape (cell shape and ions at fixed volume, with --cell-optimizer)",
    )
    add_relaxation_arguments(parser, default_fmax=0.01)
    add_property_arguments(parser, plots=True)


def run(args: argparse.Namespace) -> int:
    """Compute, write and print the equations of state."""
    return run_property_command(args, _COMMAND)


def _compute(args: argparse.Namespace, calc: Any, atoms: list[Any]) -> list[Any]:
    from nvalchemi_ase.properties import equation_of_state

    return equation_of_state(
        atoms,
        calc,
        n_volumes=args.n_volumes,
        strain=args.strain,
        relax=None if args.relax == "none" else args.relax,
        eos=args.eos,
        fmax=args.fmax,
        steps=args.steps,
        optimizer=args.optimizer,
        relax_first=args.relax_first,
        cell_optimizer=args.cell_optimizer,
    )


def _eos_row(result: EOSResult) -> tuple[str, ...]:
    import numpy as np

    lengths = np.linalg.norm(np.asarray(result.cell0), axis=1)
    return (
        f"{result.v0:.4f}",
        f"{result.e0:.6f}",
        f"{result.B:.3f}",
        " ".join(f"{x:.4f}" for x in lengths),
    )


def _plot(args: argparse.Namespace, result: EOSResult, path: Path) -> None:
    from nvalchemi_ase.properties.plots import plot_eos

    plot_eos(result, path)


def _scan(args: argparse.Namespace, result: EOSResult, path: Path) -> None:
    result.write(path, format="extxyz")


_COMMAND = PropertyCommand(
    name="eos",
    compute=_compute,
    header=("V0/Å³", "E0/eV", "B/GPa", "a,b,c at V0/Å"),
    row=_eos_row,
    extras={"eos.png": _plot, "eos.extxyz": _scan},
    wanted=lambda args, suffix: suffix != "eos.png" or not args.no_plot,
)
