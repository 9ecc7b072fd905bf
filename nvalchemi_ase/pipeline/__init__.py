"""Relax on one rank, run MD on the next: ``optimizer | md`` under torchrun.

``FIRE(images) | VelocityVerlet(images, ...)`` (or ``optimizer.pipe(md, fmax=...,
md_steps=...)``) is the two-rank form of ``optimizer + md``
(:mod:`nvalchemi_ase.compose`): rank 0 relaxes, rank 1 runs MD. Each structure
is sent to rank 1 as soon as its largest force drops below ``fmax``, enters MD
with the momenta its ``Atoms`` had when ``run()`` started (zero if none), and
finishes after ``md_steps`` MD steps, while rank 0 goes on relaxing the others.
The script is started with two ranks (``python -m torch.distributed.run
--nproc_per_node=2 script.py``); every rank builds the same ``Atoms`` and ASE
objects, and after ``run()`` every rank's ``Atoms`` hold the final state
(positions, momenta of the structures that reached MD, energy and forces), as
after the single-process fused run.

Each rank drives one of the two ASE-facing objects it was given, through their
public API only: rank 0 the optimizer (``irun(fmax=...)``, its
``converged_at_step``), rank 1 the MD object, whose one batch admits the
structures that arrive and retires those that finished
(:meth:`~nvalchemi_ase.dynamics.base.BatchedDynamics.resize`, in place: engine
state, neighbour lists and failure flags of the others carried; the resized
batch is evaluated once). So both stages have what the single-process classes
have: failure isolation (a structure that fails on either rank stops, is
reported in :attr:`RelaxThenMDPipeline.failures` by input index, step and
reason, and warned of by input index on the rank whose part failed, and the
others go on), their observers and stress on the steps where a
frame is written. The MD class must resize in place (``md.resizable()``:
``VelocityVerlet`` and the NVT thermostats ``Langevin``, ``Bussi``,
``NVTBerendsen``, ``NoseHooverChainNVT``, ``Andersen``, without a schedule):
each admitted structure takes its own per-structure arguments (``temperature_K``
and the like, as given for it at construction, ``md.parameter_table()``) and
starts with the thermostat state it would have alone; the stochastic
thermostats' noise is the MD batch's (its seed and step count, over the
structures in MD at that step), so it is not the fused run's noise.

The ranks step in lockstep: after each step both exchange what changed (the
structures rank 0 hands over, with their positions; those that finished or
failed) in one gloo collective, so a structure that converged at relaxation
step ``k`` takes its first MD step at step ``k + 1``, as in the fused run;
every rank keeps the same :attr:`~RelaxThenMDPipeline.stage`,
:attr:`~RelaxThenMDPipeline.relax_steps` and failures. The final states are
exchanged once, at the end.

Trajectories and logs (``trajectory=``, ``logfile=``, ``loginterval=``, as for
``optimizer + md``): each structure's file ends up with the frames the fused
run writes for it: frame 0, its relaxation steps and then its MD steps whose
step is a multiple of ``loginterval``, and, when every structure finished,
copies of its final state up to the fused run's last step (with the stress of
its last frame, as the fused run's copies). Each rank writes its frames with
the package's own per-structure writer (``TrajectorySet``), from an observer
of the object it drives, into hidden files beside the target
(``.NAME.relax.tmp`` on rank 0, ``.NAME.md.tmp`` on rank 1; a failed run's are
replaced); at the end rank 0 joins each structure's two parts, pads it, moves
it into place (``os.replace``) and removes the hidden files; both ranks return
once the files are whole. The logs are per rank, not merged: rank 0 writes its
relaxation lines to ``logfile``, rank 1 its MD lines to ``STEM.rank1SUFFIX``
(``md.log`` -> ``md.rank1.log``), one line per ``loginterval`` steps (none for
step 0; ``nan`` energies while a rank holds no structure). A run stopped by
``steps`` before every structure finished, or run with ``md_steps=None``,
still joins what was written, unpadded.

Agreement with ``optimizer + md`` (float64, LJ, velocity Verlet; NVTBerendsen
and noiseless Langevin with one temperature per structure;
``tests/test_pipeline.py``): every structure is handed to MD after the same
number of optimizer steps and ends where the fused run ends, to round-off, on
both ranks, and the trajectories agree frame by frame.

Checkpoints (``restart=PATH``, ``restart_interval=``, ASE's names, given to
the pipeline: ``optimizer.pipe(md, restart="pipe.npz")``; parts given their
own ``restart=`` are refused): ``PATH`` is a manifest (the package's
checkpoint format, :mod:`nvalchemi_ase.dynamics.checkpoint`) holding the step,
the state both ranks share (:attr:`~RelaxThenMDPipeline.stage`,
``relax_steps``, failures), the job's identity and the names of one file per
rank beside it (``pipe.rank0.stepN.npz``: the optimizer's checkpoint;
``pipe.rank1.stepN.npz``: the MD object's, or its bookkeeping alone while no
structure is in MD). Each rank's file carries its bookkeeping as tags: rank
0 which structures were handed over; rank 1 the input index of each row of
its MD batch, each structure's MD entry step, and the final states of the
structures that left MD; both the frames in their hidden trajectory files
and the size of their log. They are written every ``restart_interval`` steps
(default 100) and when :meth:`~RelaxThenMDPipeline.run` ends, after that
step's exchange, so no structure is in transit between the ranks. Both ranks
write their new file, then rank 0 replaces the manifest (``os.replace``),
then each removes its previous file: a kill at any point leaves a manifest
naming two files of one step (a newer file it does not name is removed when
the run continues).

If ``PATH`` exists, the pipeline continues (as ASE's ``restart=``): the
manifest must belong to the same job (the structures as given, model,
the parts' arguments, ``fmax``, ``md_steps``, ``loginterval`` and the file
names; else a :class:`~nvalchemi_ase.dynamics.checkpoint.CheckpointError`
names the field, before any file is touched). :meth:`run` then continues
rank 0's optimizer from its file, resizes rank 1's MD batch to the
checkpoint's structures (each with its own per-structure arguments) and
continues it from its file (positions, velocities, thermostat state,
neighbour lists, seed and step count: the noise of a seeded stochastic
thermostat goes on as it would have), gives back the final states of the
structures that left MD, cuts the hidden frame files and logs back to the
checkpoint (a killed run may have written more) and appends to them; a
failed structure stays failed. The optimizer's own trajectories
(``trajectory=`` given to the optimizer, written on rank 0 as the
single-process optimizer writes them) and its log continue the same way:
rank 0's file counts their frames (and the log's size), and a continued
run cuts them back to that before appending. The optimizer must then be
created with ``append_trajectory=True`` and paths (refused otherwise, on
the first run already): the script that continues creates it again, and
without that it would remove its files, with the frames written before the
checkpoint, as it is created (as ASE's does). A run stopped by
``run(steps)`` or killed and continued this way ends with every rank's
``Atoms``, trajectories and logs as the uninterrupted run's
(``tests/test_pipeline.py``: bit for bit in float64). With ``restart=`` the
hidden frame files of an unfinished run stay beside the trajectories; a
finished job launched again changes no file.

Like :mod:`nvalchemi_ase.compose`, this module sits below ``md`` and
``optimize`` and reads its parts through ``compose``'s protocols;
``BatchedOptimizer.pipe`` (and ``|``) imports it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase.compose import (
    FINISHED,
    RELAXING,
    RUNNING_MD,
    MDPart,
    OptimizerPart,
    check_parts,
)
from nvalchemi_ase.devices import GROUP_TIMEOUT
from nvalchemi_ase.dynamics.checkpoint import DEFAULT_RESTART_INTERVAL, Checkpoint
from nvalchemi_ase.dynamics.failures import (
    StructureFailedWarning,
    StructureFailure,
    warn_failures,
)
from nvalchemi_ase.dynamics.logs import open_log
from nvalchemi_ase.dynamics.trajectory import TrajectorySet
from nvalchemi_ase.pipeline.restart import (
    FRAMES_TAG,
    LOG_TAG,
    OPTIMIZER_FRAMES_TAG,
    PipelineCheckpoints,
    RankState,
    job_identity,
    restartable,
    saved_states,
    states_to_save,
    structure_state,
    write_tags,
)
from nvalchemi_ase.typing import LogfileLike, TrajectoryLike

__all__ = ["MD_RANK", "RELAX_RANK", "RelaxThenMDPipeline"]

#: The ranks of the two stages.
RELAX_RANK, MD_RANK = 0, 1

#: Step limit handed to the parts' ``irun`` (the pipeline counts its own steps).
_UNLIMITED = 2**62


class RelaxThenMDPipeline:
    """An optimizer on rank 0 feeding an MD integrator on rank 1.

    Parameters
    ----------
    optimizer : OptimizerPart
        Relaxes the structures on rank 0 (must not have run); its own
        observers, log and trajectories run there (with ``restart=``, its
        trajectories must be paths it appends to, ``append_trajectory=True``:
        a continued run keeps their frames up to the checkpoint).
    md : MDPart
        Runs MD on the same ``Atoms`` objects on rank 1 (same model; must not
        have run; resizable in place, ``md.resizable()``; no trajectory of its
        own: give ``trajectory=`` here). Its per-structure arguments are per
        input structure, as for ``optimizer + md``.
    fmax : float
        Force threshold, eV/Å, at which a structure is sent to MD (largest
        atomic force norm below fmax, the optimizer's criterion).
    md_steps : int, optional
        MD steps each structure runs on rank 1; None runs MD until
        ``run(steps)`` ends.
    trajectory : str, path or sequence of them, optional
        One ASE trajectory per structure, as for ``optimizer + md``: a template
        with ``{i}`` (index in ``images``) or one path per structure (open
        ``Trajectory`` objects are refused: each rank is its own process).
        After :meth:`run` each file holds the frames the fused run writes (see
        the module notes).
    logfile : str, path or file, optional
        Rank 0 writes its relaxation lines here (``Step relax sent Epot/N[eV]
        fmax[eV/A]``: structures relaxing, handed over or failed so far, their
        mean energy per atom and largest fmax); rank 1 writes its MD lines
        (``Time[ps] md done Epot/N[eV] T_md[K]``) to ``STEM.rank1SUFFIX`` beside
        a path (``md.log`` -> ``md.rank1.log``), or to its own ``"-"`` / open
        file. The logs are not merged.
    loginterval : int
        Frame and log interval, in steps.
    restart : str or path, optional
        The checkpoint's manifest (see the module notes): continued from if it
        exists, (re)written every ``restart_interval`` steps and when
        :meth:`run` ends; the two rank files go beside it.
    restart_interval : int, optional
        Steps between checkpoints (default
        :data:`~nvalchemi_ase.dynamics.checkpoint.DEFAULT_RESTART_INTERVAL`).

    Attributes
    ----------
    stage : numpy.ndarray, shape (B,), int
        0 still relaxing, 1 in MD, 2 finished or failed (the codes of
        :attr:`nvalchemi_ase.compose.RelaxThenMD.stage`), the same on both ranks.
    relax_steps : numpy.ndarray, shape (B,), int
        Optimizer steps each structure took on rank 0 (the step at which it
        was handed to MD, for those that were).
    failures : list of StructureFailure
        Structures that failed on either rank: input index, step (relaxation
        and MD steps, as the fused run counts) and reason; they keep their last
        good state, and the others go on.
    nsteps : int
        Steps run (each is one step of each rank); a continued run starts at
        its checkpoint's.
    continued : bool
        Whether ``restart`` named an existing checkpoint.
    md_parameters : dict of str to numpy.ndarray, shape (B,)
        The MD object's per-structure arguments (``temperature_K``, ...) as
        given at construction, input order (``md.parameter_table()``); each
        structure enters the MD batch with its own.
    """

    def __init__(
        self,
        optimizer: OptimizerPart,
        md: MDPart,
        *,
        fmax: float = 0.05,
        md_steps: int | None = None,
        trajectory: TrajectoryLike = None,
        logfile: LogfileLike = None,
        loginterval: int = 1,
        restart: str | os.PathLike[str] | None = None,
        restart_interval: int | None = None,
    ) -> None:
        check_parts(optimizer, md, operator="|")
        _check_no_constraints(md.images)
        if not md.resizable():
            raise ValueError(
                f"optimizer | md admits each structure into the MD batch when it "
                f"arrives, and this {type(md).__name__} cannot resize in place "
                "(it follows a schedule, or its class sizes its per-structure "
                "state at construction: NPT/NPH); use optimizer + md in one process"
            )
        with_restart = [
            type(part).__name__
            for part in (optimizer, md)
            if getattr(part, "restart", None) is not None
        ]
        if with_restart:
            raise ValueError(
                f"optimizer | md checkpoints both ranks together, and "
                f"{with_restart[0]} was given restart=: its own checkpoint of one "
                "rank's batch could not continue the pipeline; create the parts "
                "without restart= and give it to the pipeline "
                "(optimizer.pipe(md, restart=PATH))"
            )
        if restart is not None and optimizer.trajectories:
            _check_continuable(type(optimizer).__name__, optimizer.trajectories)
        if md.trajectories:
            raise ValueError(
                "optimizer | md writes each structure's frames into trajectory= of "
                "the pipeline; create the MD object without a trajectory"
            )
        if not fmax > 0:
            raise ValueError(f"fmax must be positive (eV/Å), got {fmax}")
        if md_steps is not None and md_steps < 1:
            raise ValueError(f"md_steps must be >= 1 or None, got {md_steps}")
        if int(loginterval) < 1:
            raise ValueError(f"loginterval must be >= 1, got {loginterval}")
        self.optimizer, self.md = optimizer, md
        self.md_parameters = md.parameter_table()
        self.images = list(md.images)
        self.fmax, self.md_steps = float(fmax), md_steps
        self.loginterval = int(loginterval)
        self.logfile = logfile
        count = len(self.images)
        self.stage: npt.NDArray[np.int64] = np.full(count, RELAXING, dtype=np.int64)
        self.relax_steps: npt.NDArray[np.int64] = np.zeros(count, dtype=np.int64)
        self.failures: list[StructureFailure] = []
        self.nsteps = 0
        self._trajectory_paths: list[Path] = []
        if trajectory is not None:
            targets = TrajectorySet(
                trajectory, count, append=True, description=self._description
            )
            if any(path is None for path in targets.paths):
                raise ValueError(
                    "optimizer | md writes trajectories by path (a template with "
                    "{i} or one path per structure), not into open Trajectory "
                    "objects: each rank is its own process"
                )
            self._trajectory_paths = [p for p in targets.paths if p is not None]
        self.restart = None if restart is None else os.fspath(restart)
        self.restart_interval = (
            DEFAULT_RESTART_INTERVAL if restart_interval is None else restart_interval
        )
        if not int(self.restart_interval) >= 1:
            raise ValueError(
                f"restart_interval must be >= 1 (steps), got {restart_interval}"
            )
        self.restart_interval = int(self.restart_interval)
        self._checkpoints = None
        manifest = None
        if self.restart is not None:
            # the job a checkpoint must belong to: inputs, model and settings
            job = job_identity(self, self._trajectory_paths, logfile)
            self._checkpoints = PipelineCheckpoints(Path(self.restart), job)
            manifest = self._checkpoints.read(self.images, md)
        if manifest is None:
            for path in self._trajectory_paths:  # as ASE does, on every rank
                path.unlink(missing_ok=True)
        else:
            self._take_manifest(manifest)
        #: Continued from a checkpoint (``restart=`` named an existing one).
        self.continued = manifest is not None
        self._resume_pending = self.continued  # the next run() takes the files
        self._ran = False

    def _description(self) -> dict[str, Any]:
        return self.todict() | {"interval": self.loginterval}

    def todict(self) -> dict[str, Any]:
        """Both parts' descriptions and the hand-over parameters."""
        return {
            "type": "relax-then-md-pipeline",
            "optimizer": self.optimizer.todict(),
            "md": self.md.todict(),
            "fmax": self.fmax,
            "md_steps": self.md_steps,
        }

    def run(self, steps: int = 100_000_000) -> bool:
        """Relax on rank 0 and run MD on rank 1 until every structure finished.

        Call it on both ranks (collective), once per pipeline object: to go
        on after ``run(steps)`` stopped, give the pipeline ``restart=`` and
        launch the script again. A process group that is not initialised
        yet is started from torchrun's environment (gloo on a CPU, NCCL on
        CUDA) and destroyed at the end.

        Parameters
        ----------
        steps : int
            Steps to run at most from :attr:`nsteps` (each is one step of each
            rank; a continued run counts from its checkpoint's step, as the
            single-process classes do).

        Returns
        -------
        bool
            True when every structure relaxed and did its ``md_steps`` MD steps
            or failed (see :attr:`failures`).

        Raises
        ------
        RuntimeError
            Outside a two-rank torch.distributed launch, or called again.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if self._ran:
            # each rank's stage lives in one run(): a second would start it
            # over (structures handed to MD again, MD progress lost)
            raise RuntimeError(
                "optimizer | md runs once per pipeline object, and this one has "
                "run; to go on after run(steps) stopped it, give the pipeline "
                "restart=PATH and launch the script again (it continues from "
                "the checkpoint written when run() ended)"
            )
        self._ran = True
        import torch.distributed as dist

        limit = self.nsteps + steps
        with _process_group(self.md.setup.device) as group:
            rank = dist.get_rank()
            saved = None
            if self._checkpoints is not None and self._resume_pending:
                saved = self._checkpoints.rank_state(rank)
                self._resume_pending = False
            frames = self._frame_writer(rank, saved)
            stage: _Relaxation | _Dynamics = (
                _Relaxation(self, frames)
                if rank == RELAX_RANK
                else _Dynamics(self, frames)
            )
            log = self._open_log(rank, saved)
            done = False
            try:
                with stage.quiet():
                    report = stage.start() if saved is None else stage.resume(saved)
                for _ in range(steps + 1):
                    self._exchange(report, stage, group)
                    done = bool((self.stage >= FINISHED).all())
                    ending = done or self.nsteps == limit
                    if self._checkpoints is not None and self.nsteps > 0:
                        self._checkpoints.write_if_due(
                            self, stage, frames, group, ending=ending
                        )
                    if ending:
                        break
                    with stage.quiet():
                        report = stage.advance()
                    self.nsteps += 1
                    if log is not None and self.nsteps % self.loginterval == 0:
                        log.write(stage.log_line())
            finally:
                with stage.quiet():
                    stage.close()
                if frames is not None:
                    frames.close()
            gathered: list[Any] = [None] * dist.get_world_size()
            # also the barrier after which rank 1's frame files are complete
            dist.all_gather_object(gathered, stage.final_states(), group=group)
            self.write_back(gathered[1 - rank])
            if self._trajectory_paths:
                if rank == RELAX_RANK:
                    self._join_trajectories(done)
                dist.barrier(group=group)  # the files are whole on every rank
        return done

    # -- the exchange ----------------------------------------------------------

    def _exchange(self, report: dict[str, Any], stage: Any, group: Any) -> None:
        """Share both ranks' changes; every rank applies them in the same order."""
        import torch.distributed as dist

        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, report, group=group)
        relaxed, integrated = gathered[RELAX_RANK], gathered[MD_RANK]
        for part in (relaxed, integrated):
            for index, step, reason in part["failures"]:
                self.failures.append(StructureFailure(index, step, reason))
                self.stage[index] = FINISHED
        if isinstance(stage, _Dynamics) and integrated["failures"]:
            # the MD object's own warnings name rows of its batch (silenced)
            warn_failures(
                [StructureFailure(*failure) for failure in integrated["failures"]],
                f"optimizer | md, {type(self.md).__name__} on rank {MD_RANK}",
            )
        for index, step, *_ in relaxed["arrivals"]:
            self.stage[index] = RUNNING_MD
            self.relax_steps[index] = step
        self.stage[list(integrated["finished"])] = FINISHED
        running = self.stage == RELAXING
        self.relax_steps[running] = relaxed["nsteps"]
        if isinstance(stage, _Dynamics):
            with stage.quiet():
                stage.admit(relaxed["arrivals"], self.nsteps)

    def write_back(self, states: list[tuple[int, dict[str, Any]]]) -> None:
        """Write the other rank's final states into this rank's ``Atoms``."""
        for index, state in states:
            atoms = self.images[index]
            atoms.set_positions(state["positions"], apply_constraint=False)
            atoms.set_cell(state["cell"])
            if state["momenta"] is not None:
                atoms.set_momenta(state["momenta"], apply_constraint=False)
            if atoms.calc is None:
                atoms.calc = self.md.setup.calculator
            if hasattr(atoms.calc, "store_results"):
                atoms.calc.store_results(atoms, state["results"])
            else:
                from ase.calculators.singlepoint import SinglePointCalculator

                atoms.calc = SinglePointCalculator(atoms, **state["results"])

    # -- trajectories and logs -------------------------------------------------

    def _temporary_paths(self, which: str) -> list[Path]:
        """Return the hidden per-structure frame files of ``which`` (relax, md)."""
        return [
            path.with_name(f".{path.name}.{which}.tmp")
            for path in self._trajectory_paths
        ]

    def _frame_writer(self, rank: int, saved: RankState | None) -> TrajectorySet | None:
        """Return this rank's frame files, or None.

        A new run removes an earlier run's; a continued one cuts them back to
        the frames its checkpoint counted (a killed run may have written more)
        and appends.
        """
        self._frames_at_start = np.zeros(len(self.images), dtype=np.int64)
        if not self._trajectory_paths:
            return None
        part = "relax" if rank == RELAX_RANK else "md"
        paths = [str(path) for path in self._temporary_paths(part)]
        frames = TrajectorySet(
            paths, len(paths), append=saved is not None, description=self._description
        )
        if saved is not None:
            counts = saved.tags[FRAMES_TAG].astype(np.int64)
            frames.truncate(counts)
            self._frames_at_start = counts
        return frames

    def frame_counts(self, frames: TrajectorySet | None) -> npt.NDArray[np.int64]:
        """Frames in this rank's files now, per structure (for a checkpoint)."""
        written = 0 if frames is None else frames.written
        return self._frames_at_start + written

    def _take_manifest(self, manifest: Checkpoint) -> None:
        """Take the shared state of a checkpoint (the same on both ranks)."""
        shared = manifest.group("pipeline")
        self.nsteps = int(manifest.meta["nsteps"])
        self.stage = shared["stage"].astype(np.int64)
        self.relax_steps = shared["relax_steps"].astype(np.int64)
        self.failures = [
            StructureFailure(int(index), int(step), str(reason))
            for index, step, reason in zip(
                shared["failure_index"],
                shared["failure_step"],
                shared["failure_reason"],
                strict=True,
            )
        ]

    def shared_arrays(self) -> dict[str, npt.NDArray[Any]]:
        """Return the state both ranks hold alike, for the manifest."""
        return {
            "pipeline/stage": self.stage.copy(),
            "pipeline/relax_steps": self.relax_steps.copy(),
            "pipeline/failure_index": np.array(
                [f.index for f in self.failures], dtype=np.int64
            ),
            "pipeline/failure_step": np.array(
                [f.step for f in self.failures], dtype=np.int64
            ),
            "pipeline/failure_reason": np.array(
                [f.reason for f in self.failures], dtype=str
            ).reshape(-1),
        }

    def _join_trajectories(self, done: bool) -> None:
        """Rank 0: each structure's relaxation then MD frames into its file.

        When every structure finished (``md_steps`` set), each file is padded
        with copies of its final state (with the stress of its last frame) up
        to the fused run's last step, as ``optimizer + md`` goes on writing
        finished structures until the last one finishes.

        With ``restart=`` the hidden files of a run that did not finish stay
        (the checkpoint's frames, appended to when it continues); a finished
        job's are removed, and running it again leaves its files as they are.
        """
        from ase.calculators.singlepoint import SinglePointCalculator
        from ase.io.trajectory import Trajectory

        ends = self.relax_steps + (self.md_steps or 0)
        finished = [f.index for f in self.failures]
        last = int(np.delete(ends, finished).max(initial=0))
        pad_to = last if done and self.md_steps is not None else None
        relax, md = self._temporary_paths("relax"), self._temporary_paths("md")
        if self.restart is not None and not any(p.exists() for p in relax + md):
            return  # a finished job run again: its files are whole
        keep_parts = self.restart is not None and not done
        for index, target in enumerate(self._trajectory_paths):
            joined = target.with_name(f".{target.name}.tmp")
            with Trajectory(joined, "w") as writer:
                writer.set_description(self._description())
                final = None
                for part in (relax[index], md[index]):
                    if part.exists() and part.stat().st_size > 0:
                        with Trajectory(part, "r") as reader:
                            for final in reader:
                                writer.write(final)
                pad = 0
                if pad_to is not None and index not in finished:
                    interval = self.loginterval
                    pad = pad_to // interval - int(ends[index]) // interval
                if pad > 0:
                    atoms = self.images[index].copy()
                    results = {
                        "energy": self.images[index].get_potential_energy(),
                        "forces": self.images[index].get_forces(),
                    }
                    if final is not None and "stress" in final.calc.results:
                        results["stress"] = final.calc.results["stress"]
                    atoms.calc = SinglePointCalculator(atoms, **results)
                    for _ in range(pad):
                        writer.write(atoms)
            os.replace(joined, target)
            if not keep_parts:
                relax[index].unlink(missing_ok=True)
                md[index].unlink(missing_ok=True)

    def log_path(self, rank: int) -> Path | None:
        """Return the log file of ``rank`` (rank 1: ``STEM.rank1SUFFIX``), or None."""
        target = self.logfile
        if not target or not isinstance(target, str | os.PathLike) or target == "-":
            return None
        path = Path(target)
        if rank == MD_RANK:
            path = path.with_name(f"{path.stem}.rank1{path.suffix}")
        return path

    def _open_log(self, rank: int, saved: RankState | None) -> Any:
        """Open the log of ``rank`` (rank 1: ``STEM.rank1SUFFIX`` beside a path).

        A continued run cuts the file back to its size at the checkpoint
        (lines a killed run wrote after it would repeat) and writes no header.
        """
        target = self.logfile
        if not target:
            return None
        path = self.log_path(rank)
        if rank == MD_RANK and path is not None:
            target = str(path)
        if saved is not None:
            size = int(saved.tags[LOG_TAG][0])
            if path is not None and path.exists() and 0 <= size < path.stat().st_size:
                os.truncate(path, size)
            return open_log(target)
        log = open_log(target)
        if rank == RELAX_RANK:
            header = ("Step", "relax", "sent", "Epot/N[eV]", "fmax[eV/A]")
        else:
            header = ("Time[ps]", "md", "done", "Epot/N[eV]", "T_md[K]")
        log.write("%-9s %6s %6s %12s %10s\n" % header)
        return log


class _Frames:
    """ASE observer: the due structures' frames into a ``TrajectorySet``.

    ``due()`` says which of ``images`` (input order) took the step just made;
    the model is asked for stress on the steps the observer is due.
    """

    needs_stress = True

    def __init__(self, frames: TrajectorySet, images: list[Any], due: Any) -> None:
        self._frames, self._images, self._due = frames, images, due

    def __call__(self) -> None:
        self._frames.write(self._images, self._due())


class _Relaxation:
    """Rank 0: the optimizer, its converged structures handed over after each step."""

    def __init__(self, pipeline: RelaxThenMDPipeline, frames: TrajectorySet | None):
        self.pipeline = pipeline
        self.optimizer = pipeline.optimizer
        count = len(pipeline.images)
        self.sent = np.zeros(count, dtype=bool)
        self.reported = np.zeros(count, dtype=bool)  # failures already reported
        self._first: Iterator[bool] | None = None
        self._run: Iterator[bool] | None = None
        #: The optimizer's own trajectories when they are checkpointed
        #: (restart=): frames in its files when this run started, and what its
        #: writer had written by then.
        own = self.optimizer.trajectories
        self._own = own if pipeline.restart is not None and own else None
        self._own_start = (np.zeros(count, np.int64), np.zeros(count, np.int64))
        if frames is not None:
            self.optimizer.attach(
                _Frames(frames, pipeline.images, self._frame_due),
                interval=pipeline.loginterval,
            )

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """Return no filter: the optimizer's ``images`` are the inputs, in order."""
        return contextlib.nullcontext()

    def _frame_due(self) -> npt.NDArray[np.bool_]:
        converged_at = self.optimizer.converged_at_step
        step = self.optimizer.nsteps
        relaxing = (converged_at < 0) | (converged_at == step)
        return relaxing & ~self.sent & ~self.optimizer.failed_mask

    def start(self) -> dict[str, Any]:
        """Prime the optimizer (frame 0); nothing is handed over at step 0.

        Every structure takes at least one relaxation step, as in the fused
        run (nvalchemi's ``FusedStage`` checks convergence after a step): the
        first step is an ``irun`` with ``fmax=0``, the rest one ``irun`` with
        ``fmax``, whose start checks the state after step 1.
        """
        if self._own is not None:  # frames an appending optimizer found
            self._own_start = (self._own.frame_counts(), self._own.written.copy())
        self._first = self.optimizer.irun(fmax=0.0, steps=1, sync_atoms=False)
        next(self._first)
        return self._report()

    def resume(self, saved: RankState) -> dict[str, Any]:
        """Continue the optimizer from its checkpoint (a step >= 1).

        The run goes on as ``irun(fmax)``, whose start checks the
        checkpoint's state again: the structures it finds converged were
        handed over before the checkpoint (``sent``), so nothing is sent.
        """
        if self._own is not None:
            # frames a killed run wrote after the checkpoint would repeat
            counts = saved.tags[OPTIMIZER_FRAMES_TAG].astype(np.int64)
            self._own.truncate(counts)
            self._own_start = (counts, self._own.written.copy())
        restartable(self.optimizer).continue_from(saved.path)
        self.sent = saved.tags["sent"].astype(bool)
        self.reported = saved.tags["reported"].astype(bool)
        self._run = self.optimizer.irun(
            fmax=self.pipeline.fmax, steps=_UNLIMITED, sync_atoms=False
        )
        try:
            next(self._run)
        except StopIteration:
            self._run = None
        return _nothing() | {"nsteps": self.optimizer.nsteps}

    def write_checkpoint(self, path: Path, tags: dict[str, Any]) -> None:
        """Write the optimizer's checkpoint with this rank's bookkeeping."""
        part = restartable(self.optimizer)
        part.checkpoint_tags = {
            "sent": self.sent.copy(),
            "reported": self.reported.copy(),
            **tags,
        }
        if self._own is not None:
            frames, written = self._own_start
            counts = frames + self._own.written - written
            part.checkpoint_tags[OPTIMIZER_FRAMES_TAG] = counts
        part.write_checkpoint(path)

    def advance(self) -> dict[str, Any]:
        """One optimizer step; what changed."""
        if self._first is not None:
            next(self._first)
            _close(self._first)
            self._first = None
            self._run = self.optimizer.irun(
                fmax=self.pipeline.fmax, steps=_UNLIMITED, sync_atoms=False
            )
        if self._run is not None:
            try:
                next(self._run)
            except StopIteration:
                self._run = None
        return self._report()

    def _report(self) -> dict[str, Any]:
        failed = self.optimizer.failed_mask
        failures = [
            (f.index, f.step, f.reason)
            for f in self.optimizer.failures
            if not self.reported[f.index]
        ]
        self.reported |= failed
        converged_at = self.optimizer.converged_at_step
        arriving = (converged_at >= 0) & ~self.sent & ~failed
        arrivals = []
        if arriving.any():
            self.optimizer.sync_structures(arriving, results=True)
            for index in map(int, np.flatnonzero(arriving)):
                atoms = self.pipeline.images[index]
                arrivals.append(
                    (
                        index,
                        int(converged_at[index]),
                        atoms.positions.copy(),
                        atoms.cell.array.copy(),
                    )
                )
            self.sent |= arriving
        return {
            "arrivals": arrivals,
            "failures": failures,
            "finished": [],
            "nsteps": self.optimizer.nsteps,
        }

    def log_line(self) -> str:
        relaxing = self.pipeline.stage == RELAXING
        epot = last = float("nan")
        if relaxing.any():
            thermo = self.optimizer.per_structure_thermo()
            epot = float((thermo["epot"] / thermo["natoms"])[relaxing].mean())
            last = float(self.optimizer.fmax_per_structure[relaxing].max())
        counts = (int(relaxing.sum()), int((~relaxing).sum()))
        return "%-9d %6d %6d %12.6f %10.4f\n" % (
            self.pipeline.nsteps,
            *counts,
            epot,
            last,
        )

    def final_states(self) -> list[tuple[int, dict[str, Any]]]:
        """Return the final states of the structures that never left this rank."""
        images = self.pipeline.images
        return [
            structure_state(index, images[index], momenta=False)
            for index in map(int, np.flatnonzero(~self.sent))
        ]

    def close(self) -> None:
        for run in (self._first, self._run):
            if run is not None:
                _close(run)  # writes every structure back (end of the run)
        self._first = self._run = None


class _Dynamics:
    """Rank 1: one MD batch admitting arrivals and retiring finished structures."""

    def __init__(self, pipeline: RelaxThenMDPipeline, frames: TrajectorySet | None):
        self.pipeline = pipeline
        self.md = pipeline.md
        count = len(pipeline.images)
        #: Input index of each structure of the MD batch, in batch order.
        self.rows = np.zeros(0, dtype=np.int64)
        #: Step at which each structure entered MD (-1: not yet), input order.
        self.entered = np.full(count, -1, dtype=np.int64)
        self.done = np.zeros(count, dtype=bool)  # finished or failed in MD
        self.received = np.zeros(count, dtype=bool)
        self._run: Iterator[bool] | None = None
        if frames is not None:
            self.md.attach(
                _Frames(frames, pipeline.images, self._frame_due),
                interval=pipeline.loginterval,
            )

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Silence the MD object's failure warnings while it is driven.

        They name rows of its batch (``images[0]`` is the first structure
        admitted), not input structures; the pipeline warns of each MD
        failure by input index as it is reported
        (:meth:`RelaxThenMDPipeline._exchange`).
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StructureFailedWarning)
            yield

    def _md_steps(self) -> npt.NDArray[np.int64]:
        """MD steps each structure took, input order (0: not in MD)."""
        taken = self.md.nsteps - self.entered
        return np.where(self.entered >= 0, taken, 0)

    def _frame_due(self) -> npt.NDArray[np.bool_]:
        in_batch = np.zeros(len(self.entered), dtype=bool)
        in_batch[self.rows] = True
        failed = np.zeros_like(in_batch)
        failed[self.rows[self.md.failed_mask]] = True
        return in_batch & ~failed & (self._md_steps() >= 1)

    def start(self) -> dict[str, Any]:
        return _nothing()

    def admit(self, arrivals: list[Any], nsteps: int) -> None:
        """Retire the finished structures and admit ``arrivals`` (between steps)."""
        images = self.pipeline.images
        for index, _, positions, cell in arrivals:
            atoms = images[index]
            atoms.set_cell(cell)
            atoms.set_positions(positions, apply_constraint=False)
            self.received[index] = True
        keep = np.flatnonzero(~self.done[self.rows])
        if not arrivals and len(keep) == len(self.rows):
            return
        if not arrivals and not len(keep):
            self.close()
            self.rows = self.rows[keep]
            return
        admitted = [index for index, *_ in arrivals]
        if self._run is None:
            self.md.nsteps = nsteps
            keep = np.zeros(0, dtype=np.int64)  # between runs: the batch starts over
            self.rows = self.rows[keep]
        parameters = {
            name: values[admitted]
            for name, values in self.pipeline.md_parameters.items()
        }
        self.md.resize(
            keep, [images[index] for index in admitted], parameters=parameters
        )
        self.rows = np.concatenate([self.rows[keep], np.asarray(admitted, np.int64)])
        self.entered[admitted] = nsteps
        if self._run is None:
            self._run = self.md.irun(steps=_UNLIMITED, sync_atoms=False)
            next(self._run)  # the resize evaluated the batch; nothing runs

    def resume(self, saved: RankState) -> dict[str, Any]:
        """Continue from this rank's checkpoint.

        The structures that left MD before it get their final state back
        (saved in the file); those in the MD batch are admitted again, in
        batch order and with their own per-structure arguments, and the MD
        object continues from its checkpoint (positions, velocities,
        thermostat state, neighbour lists, step count and seed). With no MD
        batch, the engine's step count is taken back alone: the noise of the
        stochastic thermostats counts the engine's steps since the start.
        """
        tags = saved.tags
        self.rows = tags["rows"].astype(np.int64)
        self.entered = tags["entered"].astype(np.int64)
        self.done = tags["done"].astype(bool)
        self.received = tags["received"].astype(bool)
        self.pipeline.write_back(saved_states(tags, self.pipeline.images))
        # the noise of a stochastic thermostat counts the engine's steps
        restartable(self.md).engine.step_count = int(tags["engine_steps"][0])
        if len(self.rows):
            images = self.pipeline.images
            admitted = self.rows.tolist()
            parameters = {
                name: values[admitted]
                for name, values in self.pipeline.md_parameters.items()
            }
            self.md.resize(
                np.zeros(0, dtype=np.int64),
                [images[index] for index in admitted],
                parameters=parameters,
            )
            restartable(self.md).continue_from(saved.path)
            self._run = self.md.irun(steps=_UNLIMITED, sync_atoms=False)
            next(self._run)  # the checkpoint's state, evaluated; nothing runs
        return _nothing()

    def write_checkpoint(self, path: Path, tags: dict[str, Any]) -> None:
        """Write the MD object's checkpoint (or, with no MD batch, the tags alone).

        The final states of the structures that left MD go with it: after a
        restart, this rank's ``Atoms`` of those structures hold the inputs.
        """
        left = self.received & self.done
        left[self.rows] = False
        tags = {
            "rows": self.rows.copy(),
            "entered": self.entered.copy(),
            "done": self.done.copy(),
            "received": self.received.copy(),
            **states_to_save(np.flatnonzero(left), self.pipeline.images),
            "engine_steps": np.array([restartable(self.md).engine.step_count]),
            **tags,
        }
        if self._run is None:
            write_tags(path, MD_RANK, tags)
            return
        part = restartable(self.md)
        part.checkpoint_tags = tags
        part.write_checkpoint(path)

    def advance(self) -> dict[str, Any]:
        """One MD step of the structures in MD; what finished or failed."""
        if self._run is None:
            return _nothing()
        next(self._run)
        failed_rows = self.md.failed_mask
        failures = [
            (int(self.rows[f.index]), f.step, f.reason)
            for f in self.md.failures
            if not self.done[self.rows[f.index]]
        ]
        finished = np.zeros(len(self.rows), dtype=bool)
        if self.pipeline.md_steps is not None:
            finished = self._md_steps()[self.rows] >= self.pipeline.md_steps
        finished &= ~failed_rows
        leaving = (finished | failed_rows) & ~self.done[self.rows]
        if leaving.any():
            self.md.sync_structures(leaving, results=True)
        self.done[self.rows[leaving]] = True
        report = _nothing()
        report["failures"] = failures
        report["finished"] = [int(i) for i in self.rows[finished & leaving]]
        return report

    def log_line(self) -> str:
        from nvalchemi_ase.units import ase_time_to_ps

        active = ~self.done[self.rows]
        epot = temperature = float("nan")
        if self._run is not None and active.any():
            thermo = self.md.per_structure_thermo()
            epot = float((thermo["epot"] / thermo["natoms"])[active].mean())
            temperature = float(thermo["temperature"][active].mean())
        counts = (int(active.sum()), int((self.pipeline.stage >= FINISHED).sum()))
        time = ase_time_to_ps(self.pipeline.nsteps * self.md.dt)
        return "%-9.4f %6d %6d %12.6f %10.4f\n" % (time, *counts, epot, temperature)

    def final_states(self) -> list[tuple[int, dict[str, Any]]]:
        """Return the final states of the structures that reached MD."""
        images = self.pipeline.images
        return [
            structure_state(index, images[index], momenta=True)
            for index in map(int, np.flatnonzero(self.received))
        ]

    def close(self) -> None:
        if self._run is not None:
            _close(self._run)  # writes every structure back (end of the run)
            self._run = None


def _close(run: Iterator[bool]) -> None:
    """End a part's ``irun`` generator (its run's end: ``Atoms`` written)."""
    close = getattr(run, "close", None)
    if close is not None:
        close()


def _nothing() -> dict[str, Any]:
    return {"arrivals": [], "failures": [], "finished": [], "nsteps": 0}


def _check_continuable(name: str, trajectories: TrajectorySet) -> None:
    """Refuse optimizer trajectories a continued pipeline could not continue.

    Checked on every run with ``restart=``, the first included: the
    optimizer of the run that continues is created by the same script, and
    without ``append_trajectory=True`` it removes its files as it is
    created (as ASE's does), before the pipeline could keep their frames.
    """
    if any(path is None for path in trajectories.paths):
        raise ValueError(
            f"optimizer | md with restart= continues the {name}'s trajectories "
            "by path (cut back to the checkpoint's frames when a run continues), "
            "and it was given an open Trajectory; give it paths (a template "
            "with {i} or one path per structure)"
        )
    if not trajectories.append:
        raise ValueError(
            f"optimizer | md with restart= continues the {name}'s trajectories, "
            f"and the {name} was created without append_trajectory=True: when "
            "the script runs again to continue, it would remove the frames "
            "written before the checkpoint as it is created; create it with "
            "append_trajectory=True (a new job then appends to files already "
            "there, as ASE does: remove them first)"
        )


def _check_no_constraints(images: list[Any]) -> None:
    constrained = [i for i, atoms in enumerate(images) if atoms.constraints]
    if constrained:
        raise ValueError(
            f"optimizer | md does not carry ASE constraints (structures {constrained}"
            " have some); remove them, or use the single-process optimizer + md"
        )


@contextlib.contextmanager
def _process_group(device: torch.device) -> Iterator[Any]:
    """Yield a gloo group for the results, in a two-rank process group."""
    import torch.distributed as dist

    started = False
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(
                "optimizer | md runs on two ranks: start the script with "
                "python -m torch.distributed.run --nproc_per_node=2 script.py "
                "(or use optimizer + md in one process)"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
        started = True
    try:
        size = dist.get_world_size()
        if size != 2:
            raise RuntimeError(
                f"optimizer | md needs exactly 2 ranks (relax, MD), got world size "
                f"{size}: start it with --nproc_per_node=2"
            )
        group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        try:
            yield group
        finally:
            dist.destroy_process_group(group)
    finally:
        if started:
            dist.destroy_process_group()
