"""Relax on one rank, run MD on the next: ``optimizer | md`` under torchrun.

``FIRE(images) | VelocityVerlet(images, ...)`` (or ``optimizer.pipe(md, fmax=...,
md_steps=...)``) is the two-rank form of ``optimizer + md``
(:mod:`nvalchemi_ase.compose`), on nvalchemi's ``DistributedPipeline``: rank 0
relaxes, rank 1 runs MD. Each structure is sent to rank 1 as soon as its largest
force drops to ``fmax``, enters MD with the momenta its ``Atoms`` had when
``run()`` started (zero if none), and finishes after ``md_steps`` MD steps,
while rank 0 goes on relaxing the others. The script is started with two ranks
(``python -m torch.distributed.run --nproc_per_node=2 script.py``); every rank
builds the same ``Atoms`` and ASE objects, and after ``run()`` every rank's
``Atoms`` hold the final state (positions, momenta of the structures that
reached MD, energy and forces), as after the single-process fused run.

How nvalchemi 0.3's pipeline is used (each point found by running it):

* every stage needs ``buffer_config``; it is sized for the whole input
  (``BufferConfig(num_systems=B, num_nodes=V, num_edges=0)``), so one message
  can carry every structure and no structure waits for room; edges are not
  sent (each rank's neighbour hook rebuilds them);
* the first stage draws the structures from a ``SizeAwareSampler`` (its
  in-flight mode is what ends it once every structure has been sent);
* the MD stage is a one-sub-stage ``FusedStage``, because a plain pipeline
  stage graduates structures only through a convergence test, never after a
  number of steps;
* arrivals are re-evaluated on the MD rank (``reprime_on_entry``): nvalchemi
  0.3 would reuse the forces they carry, but every arrival after the first
  comes through the receive buffer with its forces zeroed;
* the MD stage has no ``sinks``: nvalchemi 0.3 drains a stage's sinks back into
  its active batch whenever the batch has room
  (``_CommunicationMixin._complete_pending_recv`` then ``_drain_sinks_to_batch``),
  so finished structures would be integrated again and the run never ends;
  finished structures are taken at ``ON_GRADUATE`` instead.

The results are exchanged once, at the end, on a gloo group of the pipeline's
own (pickled one-structure batches). The stages run with nvalchemi's own
hooks plus the neighbour list and this module's; the ASE layer's per-step
machinery (failure isolation, observers, checkpoints) is not available here,
so constraints are refused.

Trajectories and logs (``trajectory=``, ``logfile=``, ``loginterval=``, as for
``optimizer + md``): each structure's file ends up with the frames the fused
run writes for it: frame 0, its relaxation steps and then its MD steps whose
fused step (relaxation steps, plus MD steps once in MD) is a multiple of
``loginterval``, and, when every structure finished, copies of its final state
up to the fused run's last step (the fused run goes on writing finished
structures until the last one finishes). Hooks at ``BEFORE_STEP`` count each
structure's steps on its rank (arrivals waiting to be re-evaluated are not
counted) and write frame 0; hooks at ``AFTER_STEP`` copy the rows due to the
host in one transfer and write them, as they are computed, into hidden files
beside the target (``.NAME.relax.tmp`` on rank 0, ``.NAME.md.tmp`` on rank
1; each rank removes its own when the run starts, e.g. those a failed run left
behind). At the end (after the results exchange, which is the barrier) rank 0
joins each structure's relaxation and MD frames, pads it, moves it into place
(``os.replace``) and removes the hidden files; both ranks return once the files
are whole. While trajectories are written the model is asked for stress on
every step (the fused run asks on frame steps only), so frames of periodic
structures carry it. The logs are per rank, not merged: rank 0 writes its
relaxation lines to ``logfile``, rank 1 its MD lines to ``STEM.rank1SUFFIX``
(``md.log`` -> ``md.rank1.log``), one line per ``loginterval`` pipeline
iterations (none for iteration 0; ``nan`` energies while a rank holds no
structure). A run stopped by ``steps`` before every structure finished, or
run with ``md_steps=None``, still joins what was written, unpadded.

Agreement with ``optimizer + md`` (float64, LJ, velocity Verlet,
``tests/test_pipeline.py``): every structure is handed to MD after the same
number of optimizer steps and ends where the fused run ends, to round-off, on
both ranks. Rank 0 relaxes its batch in the sampler's order (size bins, round
robin), not the input order; nvalchemi's FIRE2 step is not bit-independent of
a structure's place in the batch, and FIRE's discrete decisions can amplify
that round-off (~2e-4 Å after 26 steps in the test), exactly as the fused run
of the batch in that order does. The trajectories agree frame by frame in the
same way (positions, momenta, energies, forces and, with ``loginterval=1``,
stress); with ``loginterval > 1`` the fused run's copies of a finished
structure keep the stress of its last frame step, stale when its last MD step
was not one, while the pipeline's carry the final state's.

Like :mod:`nvalchemi_ase.compose`, this module sits below ``md`` and
``optimize`` and reads its parts through ``compose``'s protocols;
``BatchedOptimizer.pipe`` (and ``|``) imports it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._compat import pipeline_all_done, pipeline_start
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.compose import (
    FINISHED,
    RELAXING,
    RUNNING_MD,
    MDPart,
    OptimizerPart,
    check_parts,
)
from nvalchemi_ase.convert import atoms_to_batch, update_atoms
from nvalchemi_ase.devices import GROUP_TIMEOUT
from nvalchemi_ase.dynamics.logs import open_log
from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
from nvalchemi_ase.dynamics.trajectory import TrajectorySet
from nvalchemi_ase.typing import LogfileLike, TrajectoryLike
from nvalchemi_ase.units import kinetic_temperature_K

__all__ = ["MD_RANK", "RELAX_RANK", "RelaxThenMDPipeline"]

#: The ranks of the two stages.
RELAX_RANK, MD_RANK = 0, 1

# Per-structure fields the pipeline adds to each structure's data.
_INDEX, _RELAX_STEPS, _IN_MD, _MD_STEPS = (
    "pipeline_index",
    "pipeline_relax_steps",
    "pipeline_in_md",
    "pipeline_md_steps",
)


class RelaxThenMDPipeline:
    """An optimizer on rank 0 feeding an MD integrator on rank 1.

    Parameters
    ----------
    optimizer : OptimizerPart
        Relaxes the structures (its parameters are used; it must not have run).
    md : MDPart
        Runs MD on the same ``Atoms`` objects (same model; must not have run).
    fmax : float
        Force threshold, eV/Å, at which a structure is sent to MD (largest
        atomic force norm <= fmax, as in ``optimizer + md``).
    md_steps : int, optional
        MD steps each structure runs on rank 1; None runs MD until
        ``run(steps)`` ends.
    trajectory : str, path or sequence of them, optional
        One ASE trajectory per structure, as for ``optimizer + md``: a template
        with ``{i}`` (index in ``images``) or one path per structure (open
        ``Trajectory`` objects are refused: each rank is its own process).
        After :meth:`run` each file holds the frames the fused run writes:
        frame 0, every ``loginterval``-th relaxation step, every MD step whose
        fused step (relaxation steps + MD steps) is a multiple of
        ``loginterval``, and, once every structure finished, copies of the
        final state up to the fused run's last step. Frames are written as
        they are computed into hidden per-rank files beside the target
        (``.NAME.relax.tmp`` on rank 0, ``.NAME.md.tmp`` on rank 1), which rank
        0 joins into the target at the end (``os.replace``) and removes.
    logfile : str, path or file, optional
        Rank 0 writes its relaxation lines here (``Step relax sent Epot/N[eV]
        fmax[eV/A]``: structures relaxing on rank 0, handed over so far, their
        mean energy per atom and largest fmax); rank 1 writes its MD lines
        (``Time[ps] md done Epot/N[eV] T_md[K]``) to ``STEM.rank1SUFFIX`` beside
        a path (``md.log`` -> ``md.rank1.log``), or to its own ``"-"`` / open
        file. The logs are not merged.
    loginterval : int
        Frame and log interval, in steps (relaxation or MD steps for frames,
        pipeline iterations for log lines).

    Attributes
    ----------
    stage : numpy.ndarray, shape (B,), int
        After :meth:`run`: 0 still relaxing, 1 in MD, 2 finished (the codes of
        :attr:`nvalchemi_ase.compose.RelaxThenMD.stage`).
    relax_steps : numpy.ndarray, shape (B,), int
        After :meth:`run`: optimizer steps each structure took on rank 0 (the
        step at which it was handed to MD, for those that were).
    nsteps : int
        Pipeline iterations run (each is one step of each rank).
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
    ) -> None:
        check_parts(optimizer, md, operator="|")
        _check_no_constraints(md.images)
        if not fmax > 0:
            raise ValueError(f"fmax must be positive (eV/Å), got {fmax}")
        if md_steps is not None and md_steps < 1:
            raise ValueError(f"md_steps must be >= 1 or None, got {md_steps}")
        self.optimizer, self.md = optimizer, md
        self.images = md.images
        self.fmax, self.md_steps = float(fmax), md_steps
        count = len(self.images)
        self.stage: npt.NDArray[np.int64] = np.full(count, RELAXING, dtype=np.int64)
        self.relax_steps: npt.NDArray[np.int64] = np.zeros(count, dtype=np.int64)
        self.nsteps = 0
        if int(loginterval) < 1:
            raise ValueError(f"loginterval must be >= 1, got {loginterval}")
        self.loginterval = int(loginterval)
        self.logfile = logfile
        if trajectory is not None:
            # checked (and existing files removed, as ASE does) on every rank
            self.trajectories = TrajectorySet(
                trajectory, count, append=False, description=self._description
            )
            if any(path is None for path in self.trajectories.paths):
                raise ValueError(
                    "optimizer | md writes trajectories by path (a template with "
                    "{i} or one path per structure), not into open Trajectory "
                    "objects: each rank is its own process"
                )
            self._trajectory_paths: list[Path] = [
                path for path in self.trajectories.paths if path is not None
            ]
        else:
            self._trajectory_paths = []

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

        Call it on both ranks (collective). A process group that is not
        initialised yet is started from torchrun's environment (gloo on a CPU,
        NCCL on CUDA) and destroyed at the end.

        Parameters
        ----------
        steps : int
            Limit on pipeline iterations (each is one step of each rank).

        Returns
        -------
        bool
            True when every structure relaxed and did its ``md_steps`` MD steps.

        Raises
        ------
        RuntimeError
            Outside a two-rank torch.distributed launch.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        import torch.distributed as dist

        with _process_group(self.md.setup.device) as group:
            rank = dist.get_rank()
            pipeline = self._build_pipeline()
            self._frame_files[rank].remove()  # a failed run's leftovers
            log = self._open_log(rank)
            outputs = self._frame_outputs()
            try:
                pipeline_start(pipeline)
                done = False
                for _ in range(steps):
                    pipeline.step()
                    self.nsteps += 1
                    if log is not None and self.nsteps % self.loginterval == 0:
                        self._write_log(log, pipeline, rank)
                    if pipeline_all_done(pipeline):
                        done = True
                        break
            finally:
                outputs.close()
                for files in self._frame_files:
                    files.close()
            gathered: list[Any] = [None] * dist.get_world_size()
            # also the barrier after which rank 1's frame files are complete
            dist.all_gather_object(gathered, self._local_frames(pipeline), group=group)
            frames = [frame for frames in gathered for frame in frames]
            self._write_back(frames)
            if self._trajectory_paths:
                if rank == RELAX_RANK:
                    self._join_trajectories(frames, done)
                dist.barrier(group=group)  # the files are whole on every rank
        return done

    # -- the stages ----------------------------------------------------------

    def _build_pipeline(self) -> Any:
        dynamics = import_quietly("nvalchemi.dynamics")
        base = import_quietly("nvalchemi.dynamics.base")
        data = self._structure_data()
        count, atoms = len(data), sum(item.num_nodes for item in data)
        buffers = base.BufferConfig(num_systems=count, num_nodes=atoms, num_edges=0)
        device_type = self.md.setup.device.type
        self._frame_files = [
            _FrameFiles(self._temporary_paths(part), self.images, momenta=part == "md")
            for part in ("relax", "md")
        ]
        relax = self._relax_stage(data, buffers, device_type)
        self._finished: list[Any] = []
        integrate = self._md_stage(buffers, device_type, count)
        return dynamics.DistributedPipeline(
            stages={RELAX_RANK: relax, MD_RANK: integrate}
        )

    def _structure_data(self) -> list[Any]:
        """One ``AtomicData`` per structure, at rest, with the pipeline's fields."""
        items = []
        self._entry_velocities: list[torch.Tensor] = []
        for index, atoms in enumerate(self.images):
            batch = atoms_to_batch(
                [atoms],
                device="cpu",
                dtype=self.md.setup.dtype,
                warn_dropped=False,
            )
            item = batch.get_data(0)
            self._entry_velocities.append(batch.velocities.clone())
            item.velocities.zero_()  # the optimizer starts at rest
            for key, value in (
                (_INDEX, index),
                (_RELAX_STEPS, 0),
                (_IN_MD, 0),
                (_MD_STEPS, 0),
            ):
                item.add_system_property(key, torch.tensor([[value]]))
            items.append(item)
        return items

    def _relax_stage(self, data: list[Any], buffers: Any, device_type: str) -> Any:
        dynamics = import_quietly("nvalchemi.dynamics")
        model = self.optimizer.model
        stages = dynamics.DynamicsStage
        frames = self._frame_files[0] if self._trajectory_paths else None
        count_steps = _CountSteps(_RELAX_STEPS, stages.BEFORE_STEP, first_frame=frames)
        hooks = [*neighbor_hooks(model, self.optimizer.neighbor_skin), count_steps]
        if frames is not None:
            hooks.append(
                _WriteFrames(count_steps, frames, self.loginterval, stages.AFTER_STEP)
            )
        relax = self.optimizer.build_engine(hooks)
        relax.convergence_hook = dynamics.ConvergenceHook.from_fmax(threshold=self.fmax)
        relax.sampler = dynamics.SizeAwareSampler(
            _Structures(data),
            max_atoms=sum(item.num_nodes for item in data),
            max_edges=None,
            max_batch_size=len(data),
        )
        _configure(relax, buffers, device_type, len(data))
        return relax

    def _md_stage(self, buffers: Any, device_type: str, count: int) -> Any:
        dynamics = import_quietly("nvalchemi.dynamics")
        stages = dynamics.DynamicsStage
        integrate = self.md.build_engine([])
        integrate.n_steps = self.md_steps
        # Arrivals get their forces evaluated on this rank: nvalchemi 0.3 would
        # reuse the ones they carry, but after the first arrival they come
        # through the receive buffer with forces zeroed, and MD's first
        # half-kick would use zero forces.
        integrate.reprime_on_entry = True
        count_steps = _CountSteps(_MD_STEPS, stages.BEFORE_STEP)
        hooks = [
            *neighbor_hooks(self.md.model, self.md.neighbor_skin),
            _EnterMD(self._entry_velocities, stages.BEFORE_STEP),
            count_steps,
        ]
        if self._trajectory_paths:
            hooks.append(
                _WriteFrames(
                    count_steps,
                    self._frame_files[1],
                    self.loginterval,
                    stages.AFTER_STEP,
                    offset=_RELAX_STEPS,
                )
            )
        hooks += [
            _KeepFinished(self._finished, stages.ON_GRADUATE),
            _DropNeighborFields(stages.AFTER_STEP),
        ]
        fused = dynamics.FusedStage(
            sub_stages=[(RUNNING_MD, integrate)],
            entry_status=RUNNING_MD,
            exit_status=FINISHED,
            hooks=hooks,
        )
        _configure(fused, buffers, device_type, count)
        return fused

    # -- trajectories and logs -------------------------------------------------

    def _temporary_paths(self, which: str) -> list[Path]:
        """Return the hidden per-structure frame files of ``which`` (relax, md)."""
        return [
            path.with_name(f".{path.name}.{which}.tmp")
            for path in self._trajectory_paths
        ]

    def _join_trajectories(
        self, frames: list[tuple[int, int, int, Any]], done: bool
    ) -> None:
        """Rank 0: each structure's relaxation then MD frames into its file.

        When every structure finished (``md_steps`` set), each file is padded
        with copies of its final state up to the fused run's last step, as
        ``optimizer + md`` goes on writing finished structures until the last
        one finishes.
        """
        from ase.io.trajectory import Trajectory

        final = {index: batch for index, _, _, batch in frames}
        ends = self.relax_steps + (self.md_steps or 0)
        last = int(ends.max()) if done and self.md_steps is not None else None
        relax, md = self._temporary_paths("relax"), self._temporary_paths("md")
        for index, target in enumerate(self._trajectory_paths):
            joined = target.with_name(f".{target.name}.tmp")
            with Trajectory(joined, "w") as writer:
                writer.set_description(self._description())
                for part in (relax[index], md[index]):
                    if part.exists() and part.stat().st_size > 0:
                        with Trajectory(part, "r") as reader:
                            for atoms in reader:
                                writer.write(atoms)
                if last is not None and index in final:
                    interval = self.loginterval
                    pad = last // interval - int(ends[index]) // interval
                    if pad > 0:
                        atoms = self.images[index].copy()
                        batch = final[index]
                        update_atoms([atoms], batch, stress="stress" in batch)
                        for _ in range(pad):
                            writer.write(atoms)
            os.replace(joined, target)
            relax[index].unlink(missing_ok=True)
            md[index].unlink(missing_ok=True)

    def _frame_outputs(self) -> contextlib.ExitStack:
        """Ask the model for stress too while trajectories are written.

        ``optimizer + md`` asks for it on the steps it writes frames; here the
        model is called inside nvalchemi's stages, so it is asked for on every
        step (frames of periodic structures then carry stress, as the fused
        run's do). Returns the context to close after the run.
        """
        stack = contextlib.ExitStack()
        config = self.md.model.model_config
        if self._trajectory_paths and "stress" in config.outputs:
            wanted = set(config.active_outputs) | {"stress"}
            stack.enter_context(self.md.model.narrowed_outputs(wanted))
        return stack

    def _open_log(self, rank: int) -> Any:
        """Open the log of ``rank`` (rank 1: ``STEM.rank1SUFFIX`` beside a path)."""
        target = self.logfile
        if not target:
            return None
        if rank == MD_RANK and isinstance(target, str | os.PathLike) and target != "-":
            path = Path(target)
            target = str(path.with_name(f"{path.stem}.rank1{path.suffix}"))
        log = open_log(target)
        if rank == RELAX_RANK:
            header = ("Step", "relax", "sent", "Epot/N[eV]", "fmax[eV/A]")
        else:
            header = ("Time[ps]", "md", "done", "Epot/N[eV]", "T_md[K]")
        log.write("%-9s %6s %6s %12s %10s\n" % header)
        return log

    def _write_log(self, log: Any, pipeline: Any, rank: int) -> None:
        """One line: this rank's structures after pipeline iteration ``nsteps``."""
        from nvalchemi_ase.units import ase_time_to_ps

        batch = pipeline.stages[rank].active_batch
        rows = 0 if batch is None else int(batch.num_graphs)
        epot = last = float("nan")
        if rows:
            with torch.no_grad():
                natoms = batch.num_nodes_per_graph.to(torch.float64)
                per_atom = batch.energy.detach().reshape(-1).to(torch.float64) / natoms
                epot = float(per_atom.mean())
                if rank == RELAX_RANK:
                    last = float(batch.forces.detach().norm(dim=1).max())
                else:
                    velocities = batch.velocities.detach().to(torch.float64)
                    kinetic = 0.5 * batch.atomic_masses.detach().to(torch.float64)
                    kinetic = kinetic * (velocities * velocities).sum(dim=1)
                    ekin = torch.zeros(rows, dtype=torch.float64)
                    ekin.index_add_(0, batch.batch_idx.long().cpu(), kinetic.cpu())
                    last = float(
                        kinetic_temperature_K(
                            ekin.numpy(), 3 * natoms.cpu().numpy()
                        ).mean()
                    )
        if rank == RELAX_RANK:
            first = "%-9d" % self.nsteps
            counts = (rows, len(self.images) - rows)
        else:
            first = "%-9.4f" % ase_time_to_ps(self.nsteps * self.md.dt)
            counts = (rows, sum(int(done.num_graphs) for done in self._finished))
        log.write("%s %6d %6d %12.6f %10.4f\n" % (first, *counts, epot, last))

    # -- the results ---------------------------------------------------------

    def _local_frames(self, pipeline: Any) -> list[tuple[int, int, int, Any]]:
        """``(index, stage, relax steps, one-structure CPU batch)`` held here."""
        import torch.distributed as dist

        rank = dist.get_rank()
        active = pipeline.stages[rank].active_batch
        held = [] if active is None or active.num_graphs == 0 else [active]
        if rank == MD_RANK:
            held = [*self._finished, *held]
        frames = []
        for batch in held:
            for row in range(batch.num_graphs):
                one = batch.index_select([row]).to("cpu")
                stage = (
                    FINISHED
                    if int(one.status.reshape(-1)[0]) >= FINISHED
                    else (RUNNING_MD if rank == MD_RANK else RELAXING)
                )
                index = int(one[_INDEX].reshape(-1)[0])
                steps = int(one[_RELAX_STEPS].reshape(-1)[0])
                frames.append((index, stage, steps, one))
        return frames

    def _write_back(self, frames: list[tuple[int, int, int, Any]]) -> None:
        """Write each structure's final state into its ``Atoms`` (this rank's)."""
        for index, stage, steps, batch in frames:
            atoms = self.images[index]
            if atoms.calc is None:
                atoms.calc = self.md.setup.calculator
            update_atoms(
                [atoms], batch, results=True, momenta=stage >= RUNNING_MD, stress=False
            )
            self.stage[index] = stage
            self.relax_steps[index] = steps


class _Structures:
    """The dataset ``SizeAwareSampler`` draws from: the structures, in order."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> tuple[Any, dict[str, int]]:
        item = self._items[index]
        return item, {"num_atoms": item.num_nodes, "num_edges": 0}

    def get_metadata(self, index: int) -> tuple[int, int]:
        return self._items[index].num_nodes, 0


class _CountSteps:
    """nvalchemi hook (``BEFORE_STEP``): count each structure's steps in ``key``.

    Structures still waiting for their first forces (refilled ones, arrivals
    re-evaluated on entry) are not counted this step; :attr:`updated` says
    which rows were, for the ``AFTER_STEP`` frame writer. With ``first_frame``
    the rows about to take their first step have frame 0 written first.
    """

    frequency = 1

    def __init__(
        self, key: str, stage: Any, first_frame: _FrameFiles | None = None
    ) -> None:
        self.stage = stage
        self.key = key
        self._first_frame = first_frame
        self.updated: torch.Tensor | None = None

    def __call__(self, ctx: Any, stage: Any) -> None:
        batch = ctx.batch
        steps = batch[self.key]
        pending = getattr(batch, "reprime_pending", None)
        count = steps.shape[0]
        updated = (
            torch.ones(count, dtype=torch.bool, device=steps.device)
            if pending is None
            else ~pending.reshape(-1)[:count].bool()
        )
        if self._first_frame is not None:
            first = torch.where(updated & (steps.reshape(-1) == 0))[0]
            self._first_frame.write(batch, first)
        with torch.no_grad():
            steps.add_(updated.to(steps).reshape(steps.shape))
        self.updated = updated


class _WriteFrames:
    """nvalchemi hook (``AFTER_STEP``): write the frames due at this step.

    A row that took a step is due when its fused step (its own step count,
    plus its relaxation steps for MD) is a multiple of ``interval``; the due
    rows are copied to the host in one transfer.
    """

    frequency = 1

    def __init__(
        self,
        counter: _CountSteps,
        frames: _FrameFiles,
        interval: int,
        stage: Any,
        offset: str | None = None,
    ) -> None:
        self.stage = stage
        self._counter, self._frames = counter, frames
        self._interval, self._offset = interval, offset

    def __call__(self, ctx: Any, stage: Any) -> None:
        updated = self._counter.updated
        if updated is None:
            return
        batch = ctx.batch
        fused_step = batch[self._counter.key].reshape(-1)
        if self._offset is not None:
            fused_step = fused_step + batch[self._offset].reshape(-1)
        due = updated & (fused_step % self._interval == 0)
        self._frames.write(batch, torch.where(due)[0])


class _FrameFiles:
    """One rank's per-structure frame files, opened on the first frame.

    Each frame is the structure's row of the batch written into a copy of its
    ``Atoms`` (positions, energy and forces; momenta on the MD rank, the
    ``Atoms``' own on the relaxation rank, as ``optimizer + md`` writes them).
    """

    def __init__(self, paths: list[Path], images: list[Any], *, momenta: bool) -> None:
        self._paths = paths
        self._images = images
        self._copies: dict[int, Any] = {}
        self._writers: dict[int, Any] = {}
        self._momenta = momenta

    def write(self, batch: Any, rows: torch.Tensor) -> None:
        if not self._paths or rows.numel() == 0:
            return
        from ase.io.trajectory import Trajectory

        selected = batch.index_select(rows).to("cpu")
        indices = [int(i) for i in selected[_INDEX].reshape(-1).tolist()]
        copies = [self._copy(index) for index in indices]
        update_atoms(
            copies, selected, momenta=self._momenta, stress="stress" in selected
        )
        for index, atoms in zip(indices, copies, strict=True):
            writer = self._writers.get(index)
            if writer is None:
                writer = Trajectory(self._paths[index], "w")
                self._writers[index] = writer
            writer.write(atoms)

    def remove(self) -> None:
        """Delete the files (before the first frame: an earlier run's)."""
        for path in self._paths:
            path.unlink(missing_ok=True)

    def _copy(self, index: int) -> Any:
        copy = self._copies.get(index)
        if copy is None:
            copy = self._copies[index] = self._images[index].copy()
        return copy

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


class _EnterMD:
    """nvalchemi hook (MD stage, ``BEFORE_STEP``): arrivals get their momenta back.

    Each arriving structure's velocities (the optimizer's, fictitious) become
    the ones its ``Atoms`` had when ``run()`` started, looked up by the
    structure's input index (nvalchemi 0.3 sends a structure's own per-system
    fields to the next rank, but not extra per-atom ones). Tensor operations
    only (no host synchronisation).

    Parameters
    ----------
    velocities : list of torch.Tensor
        Initial velocities of each structure, (n_i, 3), nvalchemi's units.
    stage : DynamicsStage
        ``BEFORE_STEP``.
    """

    frequency = 1

    def __init__(self, velocities: list[torch.Tensor], stage: Any) -> None:
        self.stage = stage
        self._velocities = torch.cat(velocities)
        counts = torch.tensor([len(v) for v in velocities])
        self._first_atom = torch.cumsum(counts, 0) - counts

    def __call__(self, ctx: Any, stage: Any) -> None:
        batch = ctx.batch
        in_md = batch[_IN_MD]
        device = batch.velocities.device
        if self._velocities.device != device:
            self._velocities = self._velocities.to(device)
            self._first_atom = self._first_atom.to(device)
        system = batch.batch_idx.long()
        local = torch.arange(batch.num_nodes, device=device) - batch.batch_ptr[system]
        index = batch[_INDEX].reshape(-1)[system]
        initial = self._velocities[self._first_atom[index] + local]
        entering = (in_md.reshape(-1) == 0)[system]
        with torch.no_grad():
            velocities = batch.velocities
            velocities.copy_(torch.where(entering[:, None], initial, velocities))
            in_md.fill_(1)


class _KeepFinished:
    """nvalchemi hook (MD stage, ``ON_GRADUATE``): keep finished structures.

    They leave the MD stage's batch right after this step; a copy on the CPU
    is appended to ``finished``.
    """

    frequency = 1

    def __init__(self, finished: list[Any], stage: Any) -> None:
        self.stage = stage
        self._finished = finished

    def __call__(self, ctx: Any, stage: Any) -> None:
        mask = getattr(ctx, "graduated_mask", None)
        if mask is None:
            return
        rows = torch.where(mask.reshape(-1))[0]
        if rows.numel():
            self._finished.append(ctx.batch.index_select(rows).to("cpu"))


class _DropNeighborFields:
    """nvalchemi hook (MD stage, ``AFTER_STEP``): leave no neighbour list behind.

    nvalchemi 0.3 makes a receiving stage's buffer from its own batch, neighbour
    matrix included, whose width (neighbours per atom) changes between
    rebuilds; arrivals then no longer append to the batch (``ValueError: Key
    'neighbor_matrix' has incompatible shape``). Without the fields between
    steps, the buffer and the batch agree, and the neighbour hook rebuilds the
    list before each evaluation.
    """

    frequency = 1

    def __init__(self, stage: Any) -> None:
        self.stage = stage

    def __call__(self, ctx: Any, stage: Any) -> None:
        batch = ctx.batch
        for key in _NEIGHBOR_FIELDS:
            if key in batch:
                del batch[key]


_NEIGHBOR_FIELDS = (
    "neighbor_matrix",
    "num_neighbors",
    "neighbor_matrix_shifts",
    "neighbor_list",
    "neighbor_list_shifts",
)


def _configure(engine: Any, buffers: Any, device_type: str, count: int) -> None:
    """Make ``engine`` a pipeline stage (attributes of nvalchemi's comms mixin)."""
    engine.buffer_config = buffers
    engine.device_type = device_type
    engine.max_batch_size = count


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
