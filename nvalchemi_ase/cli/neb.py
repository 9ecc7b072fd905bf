"""``nvalchemi-ase neb``: nudged elastic bands for many paths at once.

Paths are given as endpoint pairs (``--initial A1 A2 ... --final B1 B2 ...``:
the k-th initial frame goes with the k-th final frame, over all files in
order; interior images are interpolated, IDPP by default) or as whole bands
(``--bands FILE ...``: each file is one band, or with ``--n-images N``
consecutive bands of N frames; used as given unless ``--interpolate`` is
passed). All paths relax in one batch on nvalchemi's NEB engine (climbing
image by default), each converging on its own (``--fmax``, eV/Å).

Outputs, with ``--prefix PREFIX`` (default ``neb``):

* ``PREFIX-band-NNN.extxyz``: each relaxed band, one frame per image, with its
  energy (eV) and forces (eV/Å); ``info``: ``path``, ``image``, ``source``;
* ``PREFIX-barriers.csv``: one row per path: forward and reverse barriers and
  reaction energy (eV, from the images), highest image, converged, steps, fmax;
* ``PREFIX-bands.png``: energy along every band (ASE's force-consistent fit).

A path whose images fail (non-finite or exploding forces) stops alone: its
band is written in its last finite state without results, its row says
FAILED and why, and the exit status is 1. Files are written as
NAME.partial.EXT and renamed when the run completes; existing outputs are
replaced only with --overwrite, and an output that is an input is refused.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi_ase.cli.common import Source
    from nvalchemi_ase.cli.outputs import OutputFiles
    from nvalchemi_ase.mep.paths import PathResult

__all__ = ["BARRIER_COLUMNS", "add_arguments", "run"]

#: Columns of ``PREFIX-barriers.csv``.
BARRIER_COLUMNS = (
    "path",
    "initial",
    "final",
    "images",
    "barrier_forward_eV",
    "barrier_reverse_eV",
    "reaction_energy_eV",
    "highest_image",
    "converged",
    "steps",
    "fmax_eV_per_A",
    "failure",
)


@dataclass
class _Path:
    """One input path: its frames and where they came from."""

    frames: list[Any]
    initial: str
    final: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``neb`` options."""
    from nvalchemi_ase.cli.common import (
        add_model_options,
        add_overwrite_option,
        positive_float,
        positive_int,
    )

    inputs = parser.add_argument_group("paths (pairs or bands)")
    inputs.add_argument(
        "--initial", nargs="+", default=[], metavar="FILE", help="initial states"
    )
    inputs.add_argument(
        "--final", nargs="+", default=[], metavar="FILE", help="final states"
    )
    inputs.add_argument(
        "--bands", nargs="+", default=[], metavar="FILE", help="whole bands"
    )
    parser.add_argument(
        "--n-images",
        type=positive_int,
        default=None,
        help="images per path, endpoints included (pairs: default 7; bands: "
        "frames per band, default the whole file)",
    )
    parser.add_argument(
        "--interpolate",
        choices=("linear", "idpp"),
        default=None,
        help="interior images from the endpoints (default: idpp for pairs, the "
        "given images for bands)",
    )
    parser.add_argument(
        "--climb",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="climbing image (default: on)",
    )
    parser.add_argument(
        "--fmax",
        type=positive_float,
        default=0.05,
        help="convergence threshold per path on the largest NEB force, eV/Å "
        "(default: 0.05)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=1000, help="step limit (default: 1000)"
    )
    parser.add_argument(
        "--spring",
        type=positive_float,
        default=0.1,
        help="spring constant, eV/Å² (default: 0.1)",
    )
    parser.add_argument(
        "--prefix", default="neb", help="output file prefix (default: neb)"
    )
    parser.add_argument("--quiet", action="store_true", help="no table")
    add_overwrite_option(parser)
    add_model_options(parser)


def run(args: argparse.Namespace) -> int:
    """Relax every path in one batch; write bands, barriers and the plot."""
    from nvalchemi_ase.cli.common import build_calculator, expand_inputs, say
    from nvalchemi_ase.cli.outputs import OutputFiles
    from nvalchemi_ase.mep import plot_bands, relax_paths

    inputs = expand_inputs([*args.initial, *args.final, *args.bands])
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    paths = _read_paths(args)
    staged = _claim_outputs(outputs, args.prefix, len(paths))
    calc = build_calculator(args)
    pairs = not args.bands
    results = relax_paths(
        [path.frames for path in paths],
        calc,
        fmax=args.fmax,
        steps=args.steps,
        climb=args.climb,
        k=args.spring,
        interpolate=args.interpolate or ("idpp" if pairs else None),
        n_images=(args.n_images or 7) if pairs else None,
    )
    for index, result in enumerate(results):
        _write_band(staged["bands"][index], index, paths[index], result)
    rows = [
        _row(index, path, result)
        for index, (path, result) in enumerate(zip(paths, results, strict=True))
    ]
    _write_table(staged["table"], rows)
    plot_bands(
        results,
        staged["plot"],
        labels=[f"{k}: {path.initial}" for k, path in enumerate(paths)],
        title=f"NEB, {len(paths)} paths",
    )
    outputs.commit()
    _report(args, rows, results, say)
    return 1 if any(result.failed for result in results) else 0


# -- inputs -------------------------------------------------------------------------


def _read_paths(args: argparse.Namespace) -> list[_Path]:
    """Return the paths the options give: pairs of frames, or bands."""
    from nvalchemi_ase.cli.common import CommandError, expand_inputs, read_paths

    if args.bands and (args.initial or args.final):
        raise CommandError("give either --initial/--final pairs or --bands, not both")
    if args.bands:
        return _bands(read_paths(expand_inputs(args.bands)), args.n_images)
    if not args.initial or not args.final:
        raise CommandError("give --initial and --final files (or --bands)")
    initial = read_paths(expand_inputs(args.initial))
    final = read_paths(expand_inputs(args.final))
    if len(initial) != len(final):
        raise CommandError(
            f"{len(initial)} initial frames but {len(final)} final frames; the k-th "
            "initial frame pairs with the k-th final frame"
        )
    return [
        _Path([a.atoms, b.atoms], a.label, b.label)
        for a, b in zip(initial, final, strict=True)
    ]


def _bands(sources: list[Source], n_images: int | None) -> list[_Path]:
    """Split each file's frames into bands (whole file, or ``n_images`` each)."""
    from nvalchemi_ase.cli.common import CommandError

    by_file: dict[str, list[Source]] = {}
    for source in sources:
        by_file.setdefault(source.path, []).append(source)
    paths = []
    for name, frames in by_file.items():
        size = n_images or len(frames)
        if size < 3 or len(frames) % size:
            raise CommandError(
                f"{name}: {len(frames)} frames do not make bands of {size} images "
                "(at least 3 each; --n-images sets the frames per band)"
            )
        for start in range(0, len(frames), size):
            band = frames[start : start + size]
            paths.append(_Path([s.atoms for s in band], band[0].label, band[-1].label))
    return paths


def _claim_outputs(outputs: OutputFiles, prefix: str, count: int) -> dict[str, Any]:
    """Staged paths of every output, claimed before any work."""
    stem = Path(prefix)
    staged: dict[str, Any] = {
        "bands": [
            outputs.claim(stem.with_name(f"{stem.name}-band-{k:03d}.extxyz"))
            for k in range(count)
        ],
        "table": outputs.claim(stem.with_name(f"{stem.name}-barriers.csv")),
        "plot": outputs.claim(stem.with_name(f"{stem.name}-bands.png")),
    }
    staged["table"].parent.mkdir(parents=True, exist_ok=True)
    return staged


# -- outputs ------------------------------------------------------------------------


def _write_band(staged: Path, index: int, path: _Path, result: PathResult) -> None:
    from ase.calculators.singlepoint import SinglePointCalculator

    from nvalchemi_ase.io_safe import write_frames

    frames = []
    for position, image in enumerate(result.images):
        frame = image.copy()
        if not result.failed:
            frame.calc = SinglePointCalculator(
                frame,
                energy=image.get_potential_energy(),
                forces=image.get_forces(apply_constraint=False),
            )
        frame.info.update(path=index, image=position, source=path.initial)
        if result.failed:
            frame.info["failure"] = result.failure
        frames.append(frame)
    write_frames(staged, frames, format="extxyz")


def _row(index: int, path: _Path, result: PathResult) -> tuple[str, ...]:
    import math

    def number(value: float) -> str:
        return "nan" if math.isnan(value) else f"{value:.6f}"

    return (
        str(index),
        path.initial,
        path.final,
        str(len(result.images)),
        number(result.barrier_forward),
        number(result.barrier_reverse),
        number(result.reaction_energy) if not result.failed else "nan",
        str(result.highest_image),
        "FAILED" if result.failed else ("yes" if result.converged else "NO"),
        str(result.steps),
        number(result.fmax),
        result.failure or "",
    )


def _write_table(staged: Path, rows: list[tuple[str, ...]]) -> None:
    import csv

    with staged.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(BARRIER_COLUMNS)
        writer.writerows(rows)


def _report(
    args: argparse.Namespace,
    rows: list[tuple[str, ...]],
    results: list[PathResult],
    say: Any,
) -> None:
    from nvalchemi_ase.cli._table import format_table
    from nvalchemi_ase.cli.runs import report

    header = ("path", "initial", "images", "Ef/eV", "Er/eV", "dE/eV", "converged")
    say(
        args,
        format_table(
            header, [(r[0], r[1], r[3], r[4], r[5], r[6], r[8]) for r in rows]
        ),
    )
    for row, result in zip(rows, results, strict=True):
        if result.failed:
            report(args.command, f"path {row[0]} ({row[1]}): {result.failure}")
    converged = sum(result.converged for result in results)
    prefix = args.prefix
    say(
        args,
        f"{converged}/{len(results)} paths converged to fmax {args.fmax} eV/Å; wrote "
        f"{prefix}-band-*.extxyz, {prefix}-barriers.csv, {prefix}-bands.png",
    )
