"""Dispatcher for the ``nvalchemi-ase`` command (``python -m nvalchemi_ase``).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from nvalchemi_ase import __version__
from nvalchemi_ase.cli.common import USER_ERRORS, CommandError
from nvalchemi_ase.cli.signals import REQUEUE_STATUS, SignalInterrupt, StopSignals

#: Exit status after Ctrl-C outside a batch (128 + SIGINT).
_INTERRUPTED = 130

# (name, module, one-line help)
_COMMANDS = (
    ("calc", "nvalchemi_ase.cli.calc", "single points for every input frame, batched"),
    ("relax", "nvalchemi_ase.cli.relax", "relax every input structure, batched"),
    ("md", "nvalchemi_ase.cli.md", "molecular dynamics of every input, batched"),
    ("eos", "nvalchemi_ase.cli.eos", "equations of state of every input, batched"),
    ("elastic", "nvalchemi_ase.cli.elastic", "elastic constants, batched"),
    ("phonons", "nvalchemi_ase.cli.phonons", "phonons (phonopy) of every input"),
    (
        "surface",
        "nvalchemi_ase.cli.surface",
        "surface energies of every input, batched",
    ),
    ("defect", "nvalchemi_ase.cli.defect", "point-defect formation energies, batched"),
    ("kappa", "nvalchemi_ase.cli.kappa", "lattice thermal conductivity (phono3py)"),
    ("qha", "nvalchemi_ase.cli.qha", "quasi-harmonic V(T), expansion, B(T), G(T)"),
    ("neb", "nvalchemi_ase.cli.neb", "nudged elastic bands, many paths in one batch"),
    ("rdf", "nvalchemi_ase.cli.rdf", "radial distribution functions of trajectories"),
    (
        "diffusion",
        "nvalchemi_ase.cli.diffusion",
        "self-diffusion (MSD, VACF) and viscosity of trajectories",
    ),
    ("models", "nvalchemi_ase.cli.models", "list every model name and what it needs"),
    (
        "demo",
        "nvalchemi_ase.cli.demo",
        "relax and run MD on a batch of real structures",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered.

    Returns
    -------
    argparse.ArgumentParser
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="nvalchemi-ase",
        description=(
            "Batched atomistic simulation with NVIDIA ALCHEMI (nvalchemi) models, "
            "ASE units throughout (Å, eV, eV/Å, eV/Å³; times in fs on the command "
            "line)."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    parser.add_argument(
        "--debug", action="store_true", help="show full tracebacks on errors"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in _COMMANDS:
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(_module=module_name)
        sub.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show full tracebacks on errors",
        )
        module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``sys.argv[1:]`` by default.

    Returns
    -------
    int
        Process exit status (0 on success).
    """
    _prefer_passive_openmp()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    module = importlib.import_module(args._module)
    signals = StopSignals()
    # commands that can be continued stop cleanly on SIGTERM/SIGINT (cli.signals)
    catching = getattr(module, "STOPS_ON_SIGNALS", False)
    args.signals = signals if catching else None
    try:
        with signals.installed() if catching else contextlib.nullcontext():
            return _run_on_every_rank(module, args)
    except SignalInterrupt as error:  # outside a run (reading, checking inputs)
        if args.debug:
            raise
        state = getattr(args, "run_state", None)
        message = (
            f"interrupted by {error.signal_name} before any structure was run; "
            "rerun the same command to start"
            if state is None
            else str(state.stopped(error.signal_name))
        )
        _print_error(args.command, message)
        return REQUEUE_STATUS
    except KeyboardInterrupt:
        if args.debug:
            raise
        state = getattr(args, "run_state", None)  # set by commands that run batches
        message = "interrupted" if state is None else str(state.interrupted())
        _print_error(args.command, message)
        return _INTERRUPTED
    except USER_ERRORS as error:
        if args.debug:
            raise
        status = getattr(error, "exit_status", CommandError.exit_status)
        message = " ".join(str(error).split())  # one line, whatever the source
        prefix = "" if status in (_INTERRUPTED, REQUEUE_STATUS) else "error: "
        _print_error(args.command, prefix + message)
        return status


def _run_on_every_rank(module: Any, args: argparse.Namespace) -> int:
    """Run the command; under ``torchrun``, on this rank's shard of the inputs.

    ``args.shard`` is this process's
    :class:`~nvalchemi_ase.runners.distributed.Shard` (the single-process one
    unless launched as one of several ranks); the runners shard the inputs
    across ranks, and only rank 0 prints results and moves outputs into place.
    """
    from nvalchemi_ase.runners.distributed import sharding

    with sharding() as shard:
        args.shard = shard
        return int(module.run(args))


def _prefer_passive_openmp() -> None:
    """Let waiting OpenMP threads sleep, unless the user chose ``OMP_WAIT_POLICY``.

    With libgomp's default policy a thread that reaches the end of a parallel
    region spins, and on a loaded machine each region then waits for a
    thread whose core another process holds: tiny torch operations (a
    ``torch.where`` on 3456 x 3 floats, a ``repeat_interleave`` of 32
    elements) took 12-16 ms instead of 10-40 µs at load 9-12 on 2 cores, and
    whole relaxations 2.7x longer; ``PASSIVE`` was as fast or faster in every
    measurement of docs/performance.md. OpenMP reads the policy once, when
    torch loads it, so this is done only in a command-line process that has
    not imported torch yet; the library itself never sets it.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _print_error(command: str, message: str) -> None:
    print(f"nvalchemi-ase {command}: {message}", file=sys.stderr)  # noqa: T201
