"""What every ``nvalchemi-ase`` subcommand shares: inputs, models, batching, output."""

from __future__ import annotations

import argparse
import glob
import importlib.util
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_EVERY",
    "USER_ERRORS",
    "CommandError",
    "Source",
    "add_batching_options",
    "add_model_options",
    "add_overwrite_option",
    "add_resume_option",
    "build_calculator",
    "default_model_name",
    "expand_inputs",
    "iter_sources",
    "parse_model_spec",
    "positive_float",
    "positive_int",
    "read_paths",
    "read_sources",
    "result_properties",
    "show_progress",
]


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status :attr:`exit_status`."""

    #: Process exit status when this error ends a command.
    exit_status = 2


#: Errors reported as one line (with --debug, as a traceback).
USER_ERRORS = (CommandError, ValueError, TypeError, OSError, ImportError, RuntimeError)


@dataclass
class Source:
    """One input structure and where it came from."""

    path: str
    frame: int
    atoms: Any

    @property
    def label(self) -> str:
        """``file@frame``, as ``ase.io.read`` spells a frame."""
        return f"{self.path}@{self.frame}"


def positive_int(text: str) -> int:
    """Argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """Argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype``."""
    parser.add_argument(
        "--model",
        default="default",
        metavar="NAME[:k=v,...]",
        help="model name and parameters, e.g. 'lj:epsilon=0.0104,sigma=3.4,cutoff=8.5' "
        "(eV, Å); 'default' is SevenNet-0 when sevenn is installed, else LJ argon",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="torch device (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "float64"),
        help="precision (default: the model's own, float64 for LJ)",
    )


def add_batching_options(parser: argparse.ArgumentParser) -> None:
    """``--batch-size``, ``--max-atoms`` (both from memory by default), ``--quiet``."""
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="largest number of structures in one batch (default: as many as "
        "fit in memory, at most 512)",
    )
    parser.add_argument(
        "--max-atoms",
        type=positive_int,
        default=None,
        help="largest number of atoms in one batch (default: from memory: "
        "batches are sized so that the model's estimated need stays below half "
        "of the memory free on the device; a structure that cannot fit is "
        "refused before any model call; giving a number replaces that check)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar and no table"
    )


def add_overwrite_option(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: replace an earlier run's outputs (once the new ones exist)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing outputs (default: refuse to run if one exists); "
        "outputs are written as NAME.partial.EXT as batches finish and renamed "
        "to NAME.EXT only when the run completes, so an earlier output survives "
        "a failed or interrupted run",
    )


#: Default of ``--checkpoint-every``, steps: the dynamics classes' default
#: ``restart_interval`` (``dynamics.checkpoint.DEFAULT_RESTART_INTERVAL``, not
#: imported here so that ``--help`` does not load torch; a test keeps them equal).
CHECKPOINT_EVERY = 100


def add_resume_option(
    parser: argparse.ArgumentParser, *, checkpoints: bool = False
) -> None:
    """``--resume`` and ``--restart``: continue an interrupted run.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The command's parser.
    checkpoints : bool
        The command writes a checkpoint of the batch in flight (``md``,
        ``relax``): ``--restart`` continues it and ``--checkpoint-every`` is
        added.
    """
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted or killed run with the same inputs and "
        "options: the structures already in its NAME.partial.EXT files are kept "
        "and not computed again (a frame cut off mid-write is dropped); without "
        "partial files the run starts from the beginning, so a job script can "
        "always pass it",
    )
    in_flight = (
        "and the batch in flight continues from its checkpoint next to the "
        "outputs (written every --checkpoint-every steps and on SIGTERM/SIGINT), "
        "so the trajectories and results are those of an uninterrupted run"
        if checkpoints
        else "(the structures in flight when it stopped are computed again)"
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help=f"as --resume, {in_flight}; on a fresh output the run simply starts, "
        "so a job script can pass it on the first run and every requeue. A run "
        f"stopped by SIGTERM or SIGINT exits with status {_requeue_status()}",
    )
    if checkpoints:
        parser.add_argument(
            "--checkpoint-every",
            type=positive_int,
            default=CHECKPOINT_EVERY,
            metavar="N",
            help="steps between checkpoint writes of the batch in flight "
            f"(default: {CHECKPOINT_EVERY}, the dynamics classes' restart_interval; "
            "each write copies the whole state to the host and syncs it to disk)",
        )


def _requeue_status() -> int:
    from nvalchemi_ase.cli.signals import REQUEUE_STATUS

    return REQUEUE_STATUS


def default_model_name() -> str:
    """SevenNet-0 when its package is installed, else Lennard-Jones argon."""
    from nvalchemi_ase.models import available_models

    if "sevennet-0" in available_models() and importlib.util.find_spec("sevenn"):
        return "sevennet-0"
    return "lj"


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``NAME[:k=v,...]`` into a name and typed parameters.

    Parameters
    ----------
    spec : str
        E.g. ``"lj:epsilon=0.0104,sigma=3.4"``; values become int, float or bool
        when they parse as such.

    Returns
    -------
    tuple of (str, dict)
        The model name (``default`` resolved) and its parameters.
    """
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise CommandError(
                f"--model {spec!r}: parameter {item!r} is not key=value "
                "(e.g. lj:epsilon=0.0104,sigma=3.4)"
            )
        params[key.strip()] = _parse_value(value.strip())
    name = name.strip() or "default"
    return (default_model_name() if name == "default" else name), params


def _parse_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def build_calculator(args: argparse.Namespace) -> Any:
    """Return the ``NVAlchemiCalculator`` the options describe."""
    from nvalchemi_ase.calculator import NVAlchemiCalculator

    name, params = parse_model_spec(args.model)
    device = args.device
    shard = getattr(args, "shard", None)
    if shard is not None:
        device = shard.device(device)  # under torchrun: this rank's own GPU
    return NVAlchemiCalculator(name, device=device, dtype=args.dtype, **params)


def read_sources(patterns: Sequence[str]) -> list[Source]:
    """Every frame of every input file (globs expanded), validated.

    Parameters
    ----------
    patterns : sequence of str
        File names or glob patterns; ``file@slice`` picks frames as in ASE.

    Returns
    -------
    list of Source
        In input order.

    Raises
    ------
    CommandError
        Naming the file (missing, unreadable) or the frame (invalid structure).
    """
    return read_paths(expand_inputs(patterns))


def read_paths(paths: Sequence[str]) -> list[Source]:
    """Every frame of files already expanded by :func:`expand_inputs`, validated.

    Parameters
    ----------
    paths : sequence of str
        Existing files, each optionally with ``@slice``.

    Returns
    -------
    list of Source
        In input order.

    Raises
    ------
    CommandError
        Naming the file (unreadable) or the frame (invalid structure).
    """
    from nvalchemi_ase.convert import StructureError, check_images

    sources = list(iter_sources(paths))
    if not sources:
        raise CommandError("no structures in the input files")
    try:
        check_images([s.atoms for s in sources])
    except StructureError as error:
        raise CommandError(structure_message(sources[error.index], error)) from error
    return sources


def iter_sources(paths: Iterable[str]) -> Iterator[Source]:
    """Every frame of files expanded by :func:`expand_inputs`, read one at a time.

    Nothing is validated here and no frame is kept: memory holds one frame
    (``ase.io.iread``), whatever the size of the files.

    Parameters
    ----------
    paths : iterable of str
        Existing files, each optionally with ``@slice``.

    Yields
    ------
    Source
        In input order, with the frame's number in its file.

    Raises
    ------
    CommandError
        Naming the file (and the frame reached) when it cannot be read.
    """
    from ase.io import iread

    for path in paths:
        name, _, index = path.partition("@")
        numbers = _frame_numbers(name, index)
        frame = None
        try:
            for frame, atoms in zip(
                numbers, iread(name, index=index or ":"), strict=False
            ):
                yield Source(name, frame, atoms)
        except Exception as error:  # ase.io raises many types for bad files
            where = name if frame is None else f"{name} after frame {frame}"
            raise CommandError(
                f"{where}: cannot read it ({type(error).__name__}: {error}); give a "
                "file ase.io.read understands (extxyz, traj, cif, POSCAR, ...)"
            ) from error


def structure_message(source: Source, error: Any) -> str:
    """``file@frame: field problem; fix`` for a ``StructureError`` of ``source``."""
    message = str(error).split(": ", 1)[1]
    return f"{source.label}: {error.field} {message}"


def _frame_numbers(name: str, index: str) -> Iterable[int]:
    """Frame numbers in the file of the frames ``name@index`` selects, in order."""
    from ase.io.formats import string2index

    selection = string2index(index or ":")
    if isinstance(selection, str):
        # a database query (``file.db@key=value``): no frame numbers in a file,
        # so the frames are numbered within the selection
        return itertools.count()
    if isinstance(selection, slice):
        start, step = selection.start or 0, selection.step or 1
        if start >= 0 and step > 0:
            return itertools.count(start, step)
    else:
        selection = slice(selection, None if selection == -1 else selection + 1)
        if selection.start >= 0:
            return [selection.start]
    from ase.io import iread

    try:  # negative indices: count the frames
        total = sum(1 for _ in iread(name, index=":"))
    except Exception:  # the read of the frames names the file
        return itertools.count()
    return range(total)[selection]


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Input files named by ``patterns``, globs expanded, each checked to exist.

    Parameters
    ----------
    patterns : sequence of str
        File names or glob patterns, each optionally with ``@slice``.

    Returns
    -------
    list of str
        One entry per file (sorted within a glob), ``@slice`` kept.

    Raises
    ------
    CommandError
        For a pattern matching nothing or a missing file.
    """
    paths: list[str] = []
    for pattern in patterns:
        name = pattern.partition("@")[0]
        matches = sorted(glob.glob(name)) if glob.has_magic(name) else [name]
        if not matches:
            raise CommandError(f"{pattern}: no file matches")
        for match in matches:
            if not Path(match).is_file():
                raise CommandError(f"{match}: no such file")
            suffix = pattern[len(name) :]
            paths.append(match + suffix)
    return paths


def result_properties(calc: Any) -> list[str]:
    """Energy, forces and, when the model computes it, stress: what outputs hold."""
    return [
        p for p in ("energy", "forces", "stress") if p in calc.implemented_properties
    ]


def show_progress(args: argparse.Namespace) -> bool | None:
    """Progress bars on a terminal unless ``--quiet``."""
    return False if getattr(args, "quiet", False) else None


def say(args: argparse.Namespace, text: str) -> None:
    """Print to stdout unless ``--quiet`` (under ``torchrun``, on rank 0 only)."""
    shard = getattr(args, "shard", None)
    if shard is not None and not shard.is_root:
        return
    if not getattr(args, "quiet", False):
        print(text, file=sys.stdout)  # noqa: T201
