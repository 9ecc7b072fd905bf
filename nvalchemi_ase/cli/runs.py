"""One command run over the runners: progress, errors naming frames, signals.

:class:`RunState` knows how many structures a run has finished and where its
results so far are, so that Ctrl-C, an out-of-memory error or any other error
in a working batch becomes one line naming the input frames (``file@frame``,
from the error's ``input_indices``, see :mod:`nvalchemi_ase.runners`) instead
of positions inside the batch, and says how to continue (``--resume``). A
SIGTERM or SIGINT caught by :mod:`nvalchemi_ase.cli.signals` ends the run with
exit status :data:`~nvalchemi_ase.cli.signals.REQUEUE_STATUS` and a line
saying where it stopped and how to continue (``--restart``).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nvalchemi_ase.cli.batching import Inputs, is_out_of_memory, out_of_memory_message
from nvalchemi_ase.cli.common import USER_ERRORS, CommandError
from nvalchemi_ase.cli.outputs import OutputFiles
from nvalchemi_ase.cli.signals import REQUEUE_STATUS, SignalInterrupt, StopSignals
from nvalchemi_ase.identity import JobMismatchError

__all__ = [
    "INTERRUPTED_STATUS",
    "Finished",
    "RunFiles",
    "RunInterruptedError",
    "RunState",
    "RunStoppedError",
    "add_run_options",
    "on_root",
    "report",
    "report_failure",
    "resumed",
    "run_structures",
    "series_of_every_rank",
    "staged_outputs",
]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED_STATUS = 130


class RunInterruptedError(CommandError):
    """Ctrl-C during a run: printed as one line, exit status 130."""

    exit_status = INTERRUPTED_STATUS


class RunStoppedError(CommandError):
    """SIGTERM or SIGINT during a run: one line, exit status 75 (requeue)."""

    exit_status = REQUEUE_STATUS


@dataclass
class RunState:
    """Where a run is: for messages on interruption and errors.

    Attributes
    ----------
    outputs : OutputFiles
        The run's outputs (staged while it runs).
    inputs : Inputs
        Labels and sizes of the input structures.
    done : int
        Structures finished, by this run or (with ``--resume``) an earlier one.
    signals : StopSignals, optional
        The command's signal handlers (:mod:`nvalchemi_ase.cli.signals`).
    """

    outputs: OutputFiles
    inputs: Inputs
    done: int = 0
    signals: StopSignals | None = None

    def interrupted(self) -> RunInterruptedError:
        """Return the one-line report of a Ctrl-C."""
        return RunInterruptedError(
            f"interrupted; {self.done} of {len(self.inputs)} structures finished, "
            f"{self.outputs.where()}; rerun the same command with --resume to "
            "continue"
        )

    def stopped(self, signal_name: str, error: Any = None) -> RunStoppedError:
        """Return the one-line report of a run stopped by a signal.

        Parameters
        ----------
        signal_name : str
            The signal, e.g. ``"SIGTERM"``.
        error : RunStopped, optional
            Where an ``md`` run stopped (its step, checkpoint and inputs).
        """
        where = ""
        checkpoint = getattr(error, "checkpoint", None)
        if error is not None and error.step is not None:
            frames = self.inputs.describe(error.input_indices)
            where = f" at step {error.step} of {frames}"
        saved = f"; checkpoint written to {checkpoint}" if checkpoint else ""
        lost = " (the structures in flight start again)" if error is None else ""
        return RunStoppedError(
            f"interrupted by {signal_name}{where}{saved}; {self.done} of "
            f"{len(self.inputs)} structures finished, {self.outputs.where()}; "
            f"rerun the same command with --restart to continue{lost}"
        )

    def finishing(self) -> contextlib.AbstractContextManager[None]:
        """Within the block (outputs moved into place), a signal waits for its end."""
        if self.signals is None:
            return contextlib.nullcontext()
        return self.signals.deferring()

    @contextlib.contextmanager
    def running(self, *, deferred: bool = False) -> Iterator[None]:
        """Run the structures; errors name the working batch and its input frames.

        Parameters
        ----------
        deferred : bool
            A first SIGTERM/SIGINT only asks the runner to stop at its next
            step boundary (the runner is given :attr:`signals` as ``stop=``);
            otherwise it stops the run at once.

        Raises
        ------
        RunStoppedError
            For SIGTERM or SIGINT caught by :attr:`signals`.
        RunInterruptedError
            For any other Ctrl-C (``KeyboardInterrupt``).
        CommandError
            For an out-of-memory error (with a ``--max-atoms`` to use) or any
            user-facing error of a batch (naming ``file@frame``).
        """
        from nvalchemi_ase.runners import RunStopped

        deferring = (
            self.signals.deferring()
            if deferred and self.signals is not None
            else contextlib.nullcontext()
        )
        try:
            with deferring:
                yield
        except SignalInterrupt as error:
            raise self.stopped(error.signal_name) from None
        except KeyboardInterrupt:
            raise self.interrupted() from None
        except RunStopped as error:
            received = None if self.signals is None else self.signals.received
            raise self.stopped(received or "a stop request", error) from None
        except CommandError:
            raise
        except JobMismatchError as error:
            self.outputs.discard_reopened()
            label = (
                self.inputs.labels[error.index]
                if error.index is not None and error.index < len(self.inputs)
                else None
            )
            what = f" ({label})" if label else ""
            raise CommandError(f"--resume: {error}{what}") from error
        except Exception as error:
            indices = getattr(error, "input_indices", None)
            where = self.outputs.where()
            if is_out_of_memory(error):
                raise CommandError(
                    out_of_memory_message(self.inputs, indices, error, where)
                ) from error
            if not isinstance(error, USER_ERRORS):
                raise
            if not indices:  # not an error of a working batch (e.g. writing)
                raise CommandError(f"{error}; {where}") from error
            text = _name_frames(str(error), self.inputs, indices)
            raise CommandError(
                f"{_blame(error, self.inputs, indices)}: {text}; {where}"
            ) from error


def _blame(error: BaseException, inputs: Inputs, indices: Sequence[int]) -> str:
    """Name the frame an error is about (``error.index``), else the batch."""
    index = getattr(error, "index", None)
    if isinstance(index, int) and 0 <= index < len(indices):
        return f"{inputs.labels[indices[index]]} (in {inputs.describe(indices)})"
    return f"in {inputs.describe(indices)}"


def _name_frames(text: str, inputs: Inputs, indices: Sequence[int]) -> str:
    """Replace ``images[i]`` and ``graph i`` (batch positions) by ``file@frame``."""

    def label(match: re.Match[str]) -> str:
        position = int(match.group(1))
        if 0 <= position < len(indices):
            return inputs.labels[indices[position]]
        return match.group(0)

    text = re.sub(r"images\[(\d+)\]", label, text)
    return re.sub(r"\bgraph (\d+)\b", label, text)


def claimed_checkpoint(path: Path, args: argparse.Namespace) -> Path:
    """Return the run's checkpoint path; an earlier run's is kept only for --restart.

    Under ``torchrun`` rank ``r > 0`` checkpoints its batch in flight to
    ``stem.rank<r>.npz`` (the runner derives it from ``path``).

    Parameters
    ----------
    path : pathlib.Path
        Where the command keeps the checkpoint of its batch in flight.
    args : argparse.Namespace
        The command's arguments (``restart``, ``resume``, ``overwrite``).

    Raises
    ------
    CommandError
        If a checkpoint is there and neither --restart (continue from it),
        --resume (run its batch again from the start) nor --overwrite is given.
    """
    from nvalchemi_ase.runners.distributed import shard_path

    rank = getattr(getattr(args, "shard", None), "rank", 0)
    own = shard_path(path, rank) if rank else path  # under torchrun, per rank
    if args.restart or not own.exists():
        return path
    if not (args.resume or args.overwrite):
        raise CommandError(
            f"{own} holds the checkpoint of an interrupted run; pass --restart "
            "to continue it, --resume to run its batch again from the start, "
            "--overwrite to discard the run, or move it away"
        )
    own.unlink()  # --resume or --overwrite: its batch runs again from the start
    return path


def remove_stale_checkpoint_writes(path: Path) -> None:
    """Remove the temporary files of checkpoint writes cut short (``kill -9``)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink()


def report(command: str, text: str) -> None:
    """Print one line to standard error (failures are shown even with --quiet)."""
    print(f"nvalchemi-ase {command}: {text}", file=sys.stderr)  # noqa: T201


def report_failure(command: str, atoms: Any, failures: Path) -> None:
    """Report one failed structure of a runner (``info`` source, steps, failure)."""
    report(
        command,
        f"{atoms.info.get('source', atoms.info['index'])} failed at step "
        f"{atoms.info['steps']}: {atoms.info['failure']}; its last finite state "
        f"goes to {failures}",
    )


def resumed(
    args: argparse.Namespace, output: Path, failures: Path, inputs: Inputs
) -> int:
    """Count what an interrupted run finished (with ``--resume``), after checking it.

    Parameters
    ----------
    args : argparse.Namespace
        ``resume``.
    output, failures : pathlib.Path
        The staged results and failures files.
    inputs : Inputs
        The labels of this run's inputs.

    Returns
    -------
    int
        Structures already finished (0 without ``--resume``).

    Raises
    ------
    CommandError
        If a finished structure is not the input at its position now (the
        inputs changed since the interrupted run).
    """
    from nvalchemi_ase.runners import finished_indices

    if not args.resume:
        return 0
    done = finished_indices(output, failures)
    for index, source in sorted(done.items()):
        expected = inputs.labels[index] if index < len(inputs) else "nothing"
        if str(source) != expected:
            raise CommandError(
                f"--resume: {output} holds {source} as structure {index}, but the "
                f"inputs give {expected} there; resume with the inputs of the "
                "interrupted run, or start again with --overwrite and without "
                "--resume"
            )
    if done and len(done) >= len(inputs):
        report(
            args.command,
            f"--resume: all {len(inputs)} structures were already finished "
            f"({output.name.replace('.partial', '')}); nothing to compute",
        )
    return len(done)


def on_root(args: argparse.Namespace) -> bool:
    """Whether this process writes the outputs and prints (rank 0, or alone)."""
    shard = getattr(args, "shard", None)
    return shard is None or bool(shard.is_root)


def series_of_every_rank(
    args: argparse.Namespace, series: dict[int, Any] | None
) -> dict[int, Any] | None:
    """Return the per-structure series (for plots) of every rank, on every rank."""
    shard = getattr(args, "shard", None)
    if series is None or shard is None or not shard.parallel:
        return series
    return dict(shard.gather(list(series.items())))


class RunFiles(Protocol):
    """The staged outputs of a runner command (``md``, ``relax``), claimed first.

    Attributes
    ----------
    output : pathlib.Path
        The staged results (the runner's ``output``).
    failed : pathlib.Path
        The staged failures (the runner's ``failures``).
    failed_final : pathlib.Path
        Where the failures end up (named in the failure lines).
    checkpoint : pathlib.Path
        Where the working batch keeps its checkpoint.
    """

    output: Path
    failed: Path
    failed_final: Path
    checkpoint: Path

    def claim_trajectories(self, outputs: OutputFiles, count: int) -> str | None:
        """Claim the trajectories of ``count`` structures; the runner's template."""

    def finish(self, series: dict[int, Any] | None, labels: Sequence[str]) -> int:
        """Write tables and plots before the outputs move; return failures."""


@dataclass(frozen=True)
class Finished:
    """What a runner command ran: its inputs and how many of them failed."""

    inputs: Inputs
    failed: int


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """Register what the runner commands share: outputs, restarts, model, batches."""
    from nvalchemi_ase.cli.common import (
        add_batching_options,
        add_model_options,
        add_overwrite_option,
        add_resume_option,
    )

    add_overwrite_option(parser)
    add_resume_option(parser, checkpoints=True)
    add_model_options(parser)
    add_batching_options(parser)


def staged_outputs(args: argparse.Namespace) -> tuple[list[str], OutputFiles]:
    """Expand the inputs and stage the outputs (``--restart`` implies ``--resume``)."""
    from nvalchemi_ase.cli.common import expand_inputs

    args.resume = args.resume or args.restart  # --restart is --resume and more
    inputs = expand_inputs(args.files)
    return inputs, OutputFiles(inputs, overwrite=args.overwrite, resume=args.resume)


def run_structures(
    args: argparse.Namespace,
    runner: Callable[..., Iterable[tuple[int, Any]]],
    inputs: list[str],
    outputs: OutputFiles,
    files: RunFiles,
    structures: Callable[[list[str]], Iterable[Any]],
    **options: Any,
) -> Finished | None:
    """Run every input through ``runner`` and move the outputs into place.

    The skeleton ``md`` and ``relax`` share: configuration errors (the
    calculator) before any frame is read, every frame checked before any model
    call, ``--resume``/``--restart`` checked against the inputs, signals and
    errors reported by :class:`RunState`, failures reported as they happen,
    and the outputs committed on rank 0 once every structure is done.

    Parameters
    ----------
    args : argparse.Namespace
        The command's arguments (model, batching, resume and checkpoint
        options, ``plot``).
    runner : callable
        :func:`~nvalchemi_ase.runners.imd` or
        :func:`~nvalchemi_ase.runners.irelax`.
    inputs, outputs
        From :func:`staged_outputs`.
    files : RunFiles
        The command's staged outputs, claimed before this call.
    structures : callable
        Yields the input structures, one at a time, from ``inputs``.
    **options
        The runner's own options (steps, dynamics or optimizer, ...).

    Returns
    -------
    Finished or None
        ``None`` on ranks other than 0 (which write and print nothing).
    """
    from nvalchemi_ase.cli.batching import scan_inputs
    from nvalchemi_ase.cli.common import (
        build_calculator,
        result_properties,
        show_progress,
    )

    calc = build_calculator(args)  # configuration errors next, before reading
    scanned = scan_inputs(inputs, calc, args)  # every frame checked, none kept
    trajectory = files.claim_trajectories(outputs, len(scanned))
    done = resumed(args, files.output, files.failed, scanned)
    state = RunState(
        outputs, scanned, done=done, signals=getattr(args, "signals", None)
    )
    args.run_state = state
    checkpoint = claimed_checkpoint(files.checkpoint, args)
    files.output.parent.mkdir(parents=True, exist_ok=True)
    series: dict[int, Any] | None = {} if args.plot else None
    with state.running(deferred=True):
        for _, atoms in runner(
            structures(inputs),
            calc,
            max_atoms=args.max_atoms,
            max_structures=scanned.budget.max_structures,
            properties=result_properties(calc),
            output=files.output,
            failures=files.failed,
            resume=args.resume,
            trajectory=trajectory,
            series=series,
            progress=show_progress(args),
            restart=checkpoint,
            restart_interval=args.checkpoint_every,
            stop=state.signals,
            **options,
        ):
            state.done += 1
            if atoms.info["failure"] is not None:
                report_failure(args.command, atoms, files.failed_final)
    series = series_of_every_rank(args, series)
    if not on_root(args):
        return None  # rank 0 moves the merged outputs into place and prints
    failed = files.finish(series, scanned.labels)
    with state.finishing():  # a signal now waits: the run is complete
        outputs.commit()
    remove_stale_checkpoint_writes(checkpoint)
    return Finished(scanned, failed)
