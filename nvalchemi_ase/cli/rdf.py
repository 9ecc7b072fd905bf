"""``nvalchemi-ase rdf``: radial distribution functions of MD trajectories.

Every input file is one structure's trajectory (an ASE ``.traj`` or extxyz
written by ``nvalchemi-ase md`` or the package's MD classes, e.g.
``trajectory="md_{i}.traj"``); ``file@slice`` selects frames (``md_0.traj@100:``
skips equilibration). For each, g(r) is averaged over the frames, in total and
for every element pair (ASE's ``get_rdf`` conventions; r in Å, rmax at most
half the smallest periodic cell width).

Outputs, after --file-prefix (a directory ending in "/", default
nvalchemi-ase-results/, or a path stem joined with "-"), with <name> the input
file's stem: <name>-rdf.csv (columns r_A, g, g_A-B ...), <name>-rdf.png (not
with --no-plot) and rdf-summary.json (inputs, options, every RDF). Files are
written as NAME.partial.EXT and renamed when the run completes; existing
outputs are replaced only with --overwrite. Nothing here needs a model.

This module also holds what ``rdf`` and ``diffusion`` share: reading the
trajectories, output naming, CSV and JSON writers.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "add_arguments",
    "add_trajectory_arguments",
    "read_trajectories",
    "run",
    "trajectory_names",
    "write_columns",
    "write_json",
]


def add_trajectory_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the inputs, ``--file-prefix``, ``--no-plot``, ``--overwrite``, etc.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The subcommand's parser.
    """
    from nvalchemi_ase.cli.common import add_overwrite_option
    from nvalchemi_ase.cli.eos import DEFAULT_PREFIX

    parser.add_argument(
        "files",
        nargs="+",
        help="trajectory files, one structure each (globs, file@slice of frames)",
    )
    parser.add_argument(
        "--file-prefix",
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help="prefix of every output: a directory ending in '/' or a path stem; "
        f"default: {DEFAULT_PREFIX}",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write PNGs")
    add_overwrite_option(parser)
    parser.add_argument(
        "--quiet", action="store_true", help="no table on standard output"
    )


def trajectory_names(inputs: Sequence[str]) -> list[str]:
    """File-name-safe, unique names of the input trajectories.

    Parameters
    ----------
    inputs : sequence of str
        Input files (``@slice`` allowed).

    Returns
    -------
    list of str
        Each file's stem (``-2``, ``-3``, ... resolve clashes).
    """
    names: list[str] = []
    for spec in inputs:
        stem = "".join(
            c if c.isalnum() or c in "._+" else "_"
            for c in Path(spec.partition("@")[0]).stem
        )
        unique, count = stem, 1
        while unique in names:
            count += 1
            unique = f"{stem}-{count}"
        names.append(unique)
    return names


def read_trajectories(
    inputs: Sequence[str], frame_interval: float | None = None
) -> list[Any]:
    """Read every input into :class:`~nvalchemi_ase.analysis.frames.Frames`.

    Parameters
    ----------
    inputs : sequence of str
        Files, each optionally ``file@slice``.
    frame_interval : float, optional
        Time between the selected frames, ASE time units (None: the ``.traj``
        header's ``timestep * interval``, times the slice's step).

    Returns
    -------
    list of Frames
        In input order.

    Raises
    ------
    CommandError
        Naming the file whose frames are unusable.
    """
    from ase.io import read

    from nvalchemi_ase.analysis.frames import load_trajectories
    from nvalchemi_ase.cli.common import CommandError

    loaded = []
    for spec in inputs:
        path, _, selection = spec.partition("@")
        try:
            if not selection:
                frames = load_trajectories([path], frame_interval, need_interval=False)
            else:
                whole = load_trajectories([path], need_interval=False)[0]
                images = read(path, index=selection)
                images = images if isinstance(images, list) else [images]
                interval = frame_interval
                if interval is None and whole.frame_interval is not None:
                    interval = whole.frame_interval * _slice_step(selection)
                frames = load_trajectories([images], interval, need_interval=False)
                frames = [_relabel(frames[0], spec)]
        except (ValueError, OSError) as error:
            message = str(error).replace("trajectories[0]", spec)
            raise CommandError(message) from error
        loaded.append(frames[0])
    return loaded


def _slice_step(selection: str) -> int:
    parts = selection.split(":")
    if len(parts) == 3 and parts[2].strip():
        return int(parts[2])
    return 1


def _relabel(frames: Any, label: str) -> Any:
    from nvalchemi_ase.analysis.frames import Frames

    return Frames(**{**frames.__dict__, "label": label})


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented UTF-8 JSON (no NaN)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(data, indent=2, allow_nan=False, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )


def write_columns(path: Path, columns: dict[str, Sequence[float]]) -> None:
    """Write equal-length columns as CSV with a header row."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(columns)
    rows = zip(*(columns[name] for name in names), strict=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(names)
        writer.writerows([f"{value:.10g}" for value in row] for row in rows)


def summary_head(command: str, args: argparse.Namespace) -> dict[str, Any]:
    """Return the part of a summary every analysis command writes."""
    from nvalchemi_ase import __version__

    options = {
        key: value
        for key, value in vars(args).items()
        if not key.startswith("_")
        and key != "files"
        and isinstance(value, str | int | float | bool | type(None) | list | tuple)
    }
    return {
        "command": f"nvalchemi-ase {command}",
        "version": __version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(),
        "options": options,
        "inputs": list(args.files),
    }


# -- rdf ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``rdf`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int

    parser.add_argument(
        "--rmax",
        type=positive_float,
        default=6.0,
        help="largest distance, Å (default: 6; at most half the cell width)",
    )
    parser.add_argument(
        "--nbins", type=positive_int, default=120, help="bins (default: 120)"
    )
    add_trajectory_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Compute and write the RDF of every input trajectory."""
    from nvalchemi_ase.analysis.plots import plot_rdf
    from nvalchemi_ase.analysis.rdf import radial_distribution
    from nvalchemi_ase.cli._table import format_table
    from nvalchemi_ase.cli.common import CommandError, expand_inputs, say
    from nvalchemi_ase.cli.eos import output_path
    from nvalchemi_ase.cli.outputs import OutputFiles

    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    names = trajectory_names(inputs)
    prefix = args.file_prefix
    csvs = [outputs.claim(output_path(prefix, name, "rdf.csv")) for name in names]
    pngs = (
        []
        if args.no_plot
        else [outputs.claim(output_path(prefix, name, "rdf.png")) for name in names]
    )
    summary_path = output_path(prefix, "rdf-summary.json")
    staged_summary = outputs.claim(summary_path)
    frames = read_trajectories(inputs)
    try:
        results = radial_distribution(frames, args.rmax, args.nbins)
    except ValueError as error:
        raise CommandError(_name_inputs(str(error), inputs)) from error
    rows = []
    for index, result in enumerate(results):
        columns: dict[str, Any] = {"r_A": result.r, "g": result.g}
        columns.update({f"g_{a}-{b}": v for (a, b), v in result.partial.items()})
        write_columns(csvs[index], columns)
        if pngs:
            plot_rdf(result, pngs[index], title=f"{names[index]}: g(r)")
        peak = int(result.g.argmax())
        rows.append(
            (
                names[index],
                str(result.n_frames),
                f"{result.r[peak]:.3f}",
                f"{result.g[peak]:.3f}",
                " ".join(f"{a}-{b}" for a, b in result.partial),
            )
        )
    write_json(
        staged_summary,
        {
            **summary_head("rdf", args),
            "results": [
                {"name": name, **result.to_dict()}
                for name, result in zip(names, results, strict=True)
            ],
        },
    )
    outputs.commit()
    header = ("trajectory", "frames", "first peak r/Å", "g max", "pairs")
    say(args, format_table(header, rows))
    say(args, f"wrote {len(csvs) + len(pngs) + 1} files (summary: {summary_path})")
    return 0


def _name_inputs(message: str, inputs: Sequence[str]) -> str:
    for index, spec in enumerate(inputs):
        message = message.replace(f"trajectories[{index}]", spec)
    return message
