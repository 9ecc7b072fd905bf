"""``nvalchemi-ase diffusion``: self-diffusion (and viscosity) of MD trajectories.

Every input file is one structure's trajectory (``.traj`` or extxyz with
momenta, as ``nvalchemi-ase md`` and the package's MD classes write them);
``file@slice`` selects frames. For each structure: the mean squared
displacement of unwrapped positions (centre-of-mass drift removed unless
--keep-drift) and its Einstein D (slope / 6, fitted over --fit-start ..
--fit-end fs, default 20-80 % of the largest lag); the velocity
autocorrelation and its Green-Kubo D (integral / 3, up to --integrate-to fs);
with --viscosity, the Green-Kubo shear viscosity from the stress (frames need
stress). Every D and η comes with the standard error of --block-length blocks
(default: five blocks). The time between frames is read from the .traj header
(timestep x loginterval) unless --timestep and --traj-every are given.

Outputs, after --file-prefix (as in ``rdf``), with <name> the input file's
stem: <name>-msd.csv, <name>-vacf.csv, <name>-viscosity.csv (lag in fs),
<name>-diffusion.png (not with --no-plot), diffusion-results.csv (one row per
structure: D in cm²/s with errors, η in mPa·s) and diffusion-summary.json
(inputs, options, every curve). Nothing here needs a model.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``diffusion`` options."""
    from nvalchemi_ase.cli.common import positive_float, positive_int
    from nvalchemi_ase.cli.rdf import add_trajectory_arguments

    parser.add_argument(
        "--timestep",
        type=positive_float,
        default=None,
        help="MD timestep of the run, fs (default: from the .traj header)",
    )
    parser.add_argument(
        "--traj-every",
        type=positive_int,
        default=1,
        help="MD steps between frames, with --timestep (default: 1)",
    )
    parser.add_argument(
        "--method",
        choices=("msd", "vacf", "both"),
        default="both",
        help="Einstein (msd), Green-Kubo (vacf, needs momenta) or both (default)",
    )
    parser.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="lags computed, frames (default: --block-length)",
    )
    parser.add_argument(
        "--block-length",
        type=positive_int,
        default=None,
        help="frames per block of the error estimate (default: a fifth of the run)",
    )
    parser.add_argument(
        "--fit-start", type=float, default=None, help="MSD fit start, fs"
    )
    parser.add_argument("--fit-end", type=float, default=None, help="MSD fit end, fs")
    parser.add_argument(
        "--integrate-to",
        type=positive_float,
        default=None,
        help="upper limit of the Green-Kubo integrals, fs (default: the window)",
    )
    parser.add_argument(
        "--keep-drift",
        action="store_true",
        help="do not remove each structure's centre-of-mass motion",
    )
    parser.add_argument(
        "--viscosity",
        action="store_true",
        help="also the Green-Kubo shear viscosity (frames need stress)",
    )
    add_trajectory_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Compute and write the diffusion coefficients of every input trajectory."""
    from ase import units

    from nvalchemi_ase.cli.common import CommandError, expand_inputs
    from nvalchemi_ase.cli.outputs import OutputFiles
    from nvalchemi_ase.cli.rdf import read_trajectories, trajectory_names

    if (args.fit_start is None) != (args.fit_end is None):
        raise CommandError("give both --fit-start and --fit-end, or neither")
    inputs = expand_inputs(args.files)
    outputs = OutputFiles(inputs, overwrite=args.overwrite)
    names = trajectory_names(inputs)
    interval = (
        None if args.timestep is None else args.timestep * args.traj_every * units.fs
    )
    staged = _claim(args, outputs, names)
    frames = read_trajectories(inputs, interval)
    for spec, item in zip(inputs, frames, strict=True):
        if item.frame_interval is None:
            raise CommandError(
                f"{spec}: time between frames unknown (no .traj header with the "
                "MD timestep); give --timestep FS and --traj-every STEPS"
            )
    try:
        results = _compute(args, frames)
    except ValueError as error:
        message = str(error)
        for index, spec in enumerate(inputs):
            message = message.replace(f"trajectories[{index}]", spec)
        raise CommandError(message) from error
    _write(args, names, results, staged)
    outputs.commit()
    return 0


def _claim(args: argparse.Namespace, outputs: Any, names: list[str]) -> dict[Any, Any]:
    from nvalchemi_ase.cli.eos import output_path

    prefix = args.file_prefix
    kinds = [kind for kind in ("msd", "vacf") if args.method in (kind, "both")]
    if args.viscosity:
        kinds.append("viscosity")
    if not args.no_plot:
        kinds.append("diffusion.png")
    staged: dict[Any, Any] = {}
    for index, name in enumerate(names):
        for kind in kinds:
            suffix = kind if kind.endswith(".png") else f"{kind}.csv"
            staged[(index, kind)] = outputs.claim(output_path(prefix, name, suffix))
    for kind in ("diffusion-results.csv", "diffusion-summary.json"):
        staged[kind] = outputs.claim(output_path(prefix, kind))
    return staged


def _compute(args: argparse.Namespace, frames: list[Any]) -> dict[str, list[Any]]:
    from nvalchemi_ase.analysis import (
        mean_squared_displacement,
        shear_viscosity,
        velocity_autocorrelation,
    )

    lengths = {"window": args.window, "block_length": args.block_length}
    fit = None if args.fit_start is None else (args.fit_start, args.fit_end)
    drift = not args.keep_drift
    results: dict[str, list[Any]] = {}
    if args.method in ("msd", "both"):
        results["msd"] = mean_squared_displacement(
            frames, **lengths, fit_window_fs=fit, remove_drift=drift
        )
    if args.method in ("vacf", "both"):
        results["vacf"] = velocity_autocorrelation(
            frames, **lengths, integrate_to_fs=args.integrate_to, remove_drift=drift
        )
    if args.viscosity:
        results["viscosity"] = shear_viscosity(
            frames, **lengths, integrate_to_fs=args.integrate_to
        )
    return results


def _write(
    args: argparse.Namespace,
    names: list[str],
    results: dict[str, list[Any]],
    staged: dict[Any, Any],
) -> None:
    import csv

    from nvalchemi_ase.analysis.plots import plot_transport
    from nvalchemi_ase.cli._table import format_table
    from nvalchemi_ase.cli.common import say
    from nvalchemi_ase.cli.rdf import summary_head, write_columns, write_json

    rows = []
    for index, name in enumerate(names):
        msd = results.get("msd", [None] * len(names))[index]
        vacf = results.get("vacf", [None] * len(names))[index]
        eta = results.get("viscosity", [None] * len(names))[index]
        if msd is not None:
            columns = {"lag_fs": msd.lag_fs, "msd_A2": msd.curve}
            columns.update({f"msd_{k}_A2": v for k, v in msd.curve_by_element.items()})
            write_columns(staged[(index, "msd")], columns)
        if vacf is not None:
            columns = {"lag_fs": vacf.lag_fs, "vacf_A2_per_fs2": vacf.curve}
            columns["running_D_A2_per_fs"] = vacf.running_diffusion
            write_columns(staged[(index, "vacf")], columns)
        if eta is not None:
            write_columns(
                staged[(index, "viscosity")],
                {
                    "lag_fs": eta.lag_fs,
                    "acf_eV2_per_A6": eta.acf,
                    "running_viscosity_mPa_s": eta.running_viscosity,
                },
            )
        if (index, "diffusion.png") in staged:
            plot_transport(msd, vacf, eta, staged[(index, "diffusion.png")], title=name)
        rows.append(_row(name, msd, vacf, eta))
    header = (
        "trajectory",
        "D_msd_cm2_s",
        "D_msd_error_cm2_s",
        "D_vacf_cm2_s",
        "D_vacf_error_cm2_s",
        "viscosity_mPa_s",
        "viscosity_error_mPa_s",
    )
    with staged["diffusion-results.csv"].open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    write_json(
        staged["diffusion-summary.json"],
        {
            **summary_head("diffusion", args),
            "results": [
                {
                    "name": name,
                    **{
                        kind: values[index].to_dict()
                        for kind, values in results.items()
                    },
                }
                for index, name in enumerate(names)
            ],
        },
    )
    say(args, format_table(header, rows))


def _row(name: str, msd: Any, vacf: Any, eta: Any) -> tuple[str, ...]:
    def text(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    return (
        name,
        text(msd and msd.diffusion_cm2_s),
        text(msd and msd.diffusion_error_cm2_s),
        text(vacf and vacf.diffusion_cm2_s),
        text(vacf and vacf.diffusion_error_cm2_s),
        text(eta and eta.viscosity),
        text(eta and eta.viscosity_error),
    )
