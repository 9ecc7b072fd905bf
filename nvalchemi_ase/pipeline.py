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
hooks plus the neighbour list; the ASE layer's per-step machinery (failure
isolation, observers, trajectories, logs, checkpoints) is not available here,
so constraints are refused and no trajectory or log is written.

Agreement with ``optimizer + md`` (float64, LJ, velocity Verlet,
``tests/test_pipeline.py``): every structure is handed to MD after the same
number of optimizer steps and ends where the fused run ends, to round-off, on
both ranks. Rank 0 relaxes its batch in the sampler's order (size bins, round
robin), not the input order; nvalchemi's FIRE2 step is not bit-independent of
a structure's place in the batch, and FIRE's discrete decisions can amplify
that round-off (~2e-4 Å after 26 steps in the test), exactly as the fused run
of the batch in that order does.

Like :mod:`nvalchemi_ase.compose`, this module sits above ``md`` and
``optimize``; ``BatchedOptimizer.pipe`` (and ``|``) imports it when called.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._compat import pipeline_all_done, pipeline_start
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.compose import FINISHED, RELAXING, RUNNING_MD, check_parts
from nvalchemi_ase.convert import atoms_to_batch, update_atoms
from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
from nvalchemi_ase.md.md import BatchedMolecularDynamics
from nvalchemi_ase.optimize.optimize import BatchedOptimizer
from nvalchemi_ase.runners.distributed import GROUP_TIMEOUT

__all__ = ["MD_RANK", "RELAX_RANK", "RelaxThenMDPipeline"]

#: The ranks of the two stages.
RELAX_RANK, MD_RANK = 0, 1

# Per-structure fields the pipeline adds to each structure's data.
_INDEX, _RELAX_STEPS, _IN_MD = (
    "pipeline_index",
    "pipeline_relax_steps",
    "pipeline_in_md",
)


class RelaxThenMDPipeline:
    """An optimizer on rank 0 feeding an MD integrator on rank 1.

    Parameters
    ----------
    optimizer : BatchedOptimizer
        Relaxes the structures (its parameters are used; it must not have run).
    md : BatchedMolecularDynamics
        Runs MD on the same ``Atoms`` objects (same model; must not have run).
    fmax : float
        Force threshold, eV/Å, at which a structure is sent to MD (largest
        atomic force norm <= fmax, as in ``optimizer + md``).
    md_steps : int, optional
        MD steps each structure runs on rank 1; None runs MD until
        ``run(steps)`` ends.

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
        optimizer: BatchedOptimizer,
        md: BatchedMolecularDynamics,
        *,
        fmax: float = 0.05,
        md_steps: int | None = None,
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
            pipeline = self._build_pipeline()
            pipeline_start(pipeline)
            done = False
            for _ in range(steps):
                pipeline.step()
                self.nsteps += 1
                if pipeline_all_done(pipeline):
                    done = True
                    break
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, self._local_frames(pipeline), group=group)
        self._write_back([frame for frames in gathered for frame in frames])
        return done

    # -- the stages ----------------------------------------------------------

    def _build_pipeline(self) -> Any:
        dynamics = import_quietly("nvalchemi.dynamics")
        base = import_quietly("nvalchemi.dynamics.base")
        data = self._structure_data()
        count, atoms = len(data), sum(item.num_nodes for item in data)
        buffers = base.BufferConfig(num_systems=count, num_nodes=atoms, num_edges=0)
        device_type = self.md.setup.device.type
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
            for key, value in ((_INDEX, index), (_RELAX_STEPS, 0), (_IN_MD, 0)):
                item.add_system_property(key, torch.tensor([[value]]))
            items.append(item)
        return items

    def _relax_stage(self, data: list[Any], buffers: Any, device_type: str) -> Any:
        dynamics = import_quietly("nvalchemi.dynamics")
        model = self.optimizer.model
        hooks = [
            *neighbor_hooks(model, self.optimizer.neighbor_skin),
            _CountRelaxSteps(),
        ]
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
        fused = dynamics.FusedStage(
            sub_stages=[(RUNNING_MD, integrate)],
            entry_status=RUNNING_MD,
            exit_status=FINISHED,
            hooks=[
                *neighbor_hooks(self.md.model, self.md.neighbor_skin),
                _EnterMD(self._entry_velocities, stages.BEFORE_STEP),
                _KeepFinished(self._finished, stages.ON_GRADUATE),
                _DropNeighborFields(stages.AFTER_STEP),
            ],
        )
        _configure(fused, buffers, device_type, count)
        return fused

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


class _CountRelaxSteps:
    """nvalchemi hook (relax stage, ``BEFORE_STEP``): count each structure's steps.

    Structures still waiting for their first forces (refilled ones) are not
    counted; every other structure in the relax stage's batch is updated.
    """

    frequency = 1

    def __init__(self) -> None:
        self.stage = import_quietly("nvalchemi.dynamics").DynamicsStage.BEFORE_STEP

    def __call__(self, ctx: Any, stage: Any) -> None:
        batch = ctx.batch
        steps = batch[_RELAX_STEPS]
        pending = getattr(batch, "reprime_pending", None)
        updated = torch.ones_like(steps) if pending is None else (~pending).to(steps)
        with torch.no_grad():
            steps.add_(updated.reshape(steps.shape))


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
