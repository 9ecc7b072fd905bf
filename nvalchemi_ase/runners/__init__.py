"""High-throughput runs: many structures through a bounded, refilled working batch.

:func:`irelax` (and :func:`relax` over it) relaxes any iterable of ``Atoms`` —
a list, ``ase.io.iread(...)``, a generator; never materialised — through a
*working batch* whose size is bounded by an atom (and edge) budget. Each
structure that finishes (converged, step limit, or failed) leaves the batch,
is yielded (and, with ``output=``, appended to an extxyz file at once), and the
next structures are admitted. :func:`isingle_points` (:func:`single_points`)
evaluates in consecutive chunks within the same budget, one
``calculate_batch`` each; :func:`imd` (:func:`md`) runs fixed-length MD in
consecutive chunks within it.

Design: one run resized in place, as nvalchemi's stages resize theirs
----------------------------------------------------------------------
nvalchemi's own in-flight machinery (``BaseDynamics(sampler=...,
refill_frequency=...)``, ``refill_check``) was read and not used directly:

* ``refill_check`` builds the admitted structures with
  ``Batch.from_data_list(AtomicData...)``, which refuses mixed periodicity and
  cells with ``det <= 0`` and drops what :mod:`nvalchemi_ase.convert` carries
  (cell padding of molecules and slabs, frozen atoms, unit optimizer masses);
* everything this package keeps per structure next to the engine — the
  :class:`~nvalchemi_ase.dynamics.failures.FailureGuard` flags and snapshots,
  the neighbour-list hooks' reference positions and sizes, the optimizer's
  convergence arrays, the ``Atoms`` written back — must be resized in step
  with the batch;
* its samplers need a sized, indexable dataset, not a stream.

So a refill resizes the one optimizer of the run in place, between two steps
of its ``irun``
(:meth:`~nvalchemi_ase.dynamics.base.BatchedDynamics.resize`): its
:class:`~nvalchemi_ase.dynamics.run.BatchRun` keeps the survivors' rows of the
batch and appends the admitted structures' (built alone by
:mod:`nvalchemi_ase.convert`); the engine's
``_sync_state_to_batch(remaining, n_new, batch)`` — the very method
``refill_check`` calls — keeps the survivors' state rows (FIRE's ``dt``,
``alpha`` and step counters, L-BFGS history, this package's BFGS Hessians,
widened if needed) and appends ``_make_new_state`` rows for the admitted
structures (:func:`nvalchemi_ase._compat.carry_engine_state`); the survivors'
velocities, failure flags and neighbour lists stay; the optimizer resizes its
``Atoms`` list, write-back references, trajectories and convergence arrays;
then the model evaluates the admitted structures alone (their own batch and
neighbour lists, which then join the survivors'), the survivors keep the
outputs of their last step, every hook stage runs over the whole batch as in
any priming, and the run goes on. Where the optimizer cannot resize (cell filters,
constraints other than ``FixAtoms``) a refill builds a new optimizer over
survivors + admitted structures and carries the same state into it
(:meth:`~nvalchemi_ase.dynamics.run.BatchRun.carry_from`). No
structure's path depends on what else is in the batch: every engine works per
structure, convergence and step limits are per structure, and the state a
structure's next step reads is its own. The cost is the admitted
structures' batch, neighbour lists and first evaluation (what a fixed chunk
spends on them too) plus the bookkeeping of resizing (the survivors' rows of
the batch, lists and state, ≈ 1-2 steps of a 4000-atom LJ batch on a CPU),
so refills are batched: one happens when a structure reaches its step
limit (it must stop moving), when every structure in the batch has finished, or
when the finished structures (which stay frozen in the batch until then, as in
a plain batched run) have cost about what a refill costs and the next queued
structure fits (or the queue is empty, to shrink the batch). A finished
structure's results are read when it finishes; from then on its atoms keep no
neighbours (``dynamics.neighbors.empty_neighbors``), so a model that sums over
the neighbour list spends next to nothing on it (an LJ evaluation of a batch
with half its atoms emptied costs 0.4 of the full one). "Cost" is counted in
atoms: each step adds the fraction of the batch's atoms that is finished, and a
refill is due once that sum reaches ``refill_steps`` (a refill's cost in steps
of the whole batch: 1 for models whose forces come by autograd,
:data:`~nvalchemi_ase.runners.relaxation._REFILL_STEPS` for direct-force models
such as LJ), so between two refills the frozen atoms cost about one refill (the
ski-rental rule), whether many structures finished at once or one finished long
ago. A refill starts the survivors' neighbour lists from their old rows
(``carry_neighbor_lists``): only the admitted structures' lists are built. The
schedule depends only on the structures' steps and sizes and the budget, so
runs repeat. The budget itself may be tuned for throughput
(:mod:`nvalchemi_ase.runners.throughput`) from a timing probe taken once per
model, device, dtype and thread count and cached, so later runs on the same
machine batch the same; every structure's path is its own either way.

With a cell filter (``cell_filter=FrechetCellFilter``) refills wait until
every structure of the working batch has finished: a variable-cell optimizer
holds each structure rotated to a lower-triangular cell and its cell degrees
of freedom relative to the cell it started from, so the state of a survivor
would not carry over into a rebuilt optimizer. Structures admitted together
have the same step limit, so none has to be stopped early.

Step limits are per structure (``steps`` of its own), as if it ran alone.
Admission is in input order; a structure that alone exceeds the budget, that
:func:`~nvalchemi_ase.convert.check_images` rejects for the model, or that has
a constraint nvalchemi cannot honour is a per-structure failure with its
reason, never a crash. An error that does stop a run (out of memory, an error
in the model) carries ``error.input_indices``: the input indices of the
structures in the working batch, in batch order (graph ``i`` of the batch, the
``images[i]`` of a message, is input ``error.input_indices[i]``).

Budget. With neither ``max_atoms`` nor ``max_edges`` the budget is the
model's memory estimate (:func:`~nvalchemi_ase.models.memory.memory_estimate`)
against :data:`~nvalchemi_ase.models.memory.SAFETY_FRACTION` of
:func:`~nvalchemi_ase.models.memory.available_memory`, as the command line
does; with either, those counts (edges: ordered pairs within the model's
cutoff, :func:`~nvalchemi_ase.models.memory.count_edges`). ``max_structures``
caps the number of structures in the batch in either case.

Modules: :mod:`~nvalchemi_ase.runners.relaxation` (the working batch of
:func:`irelax`), :mod:`~nvalchemi_ase.runners.chunks` (single points and MD),
:mod:`~nvalchemi_ase.runners.budget`, :mod:`~nvalchemi_ase.runners.files`
(streamed output, resume, reading back), :mod:`~nvalchemi_ase.runners.restart`
(the checkpoint of the MD chunk or relaxation working batch in flight,
``restart=``, and ``stop=``),
:mod:`~nvalchemi_ase.runners.distributed` (one shard of the inputs per rank
under ``torchrun``, merged by rank 0);
``_common`` holds what they share.

Streaming output and resume. With ``output=PATH`` each finished structure is
appended to ``PATH`` (extxyz, ``info["index"]`` = input index; finish order
for relaxations, input order for single points and MD) and flushed; failures
go to ``failures=`` (default :func:`failed_path`, ``info["failure"]`` holds
the reason). ``resume=True`` continues an interrupted run: every index already
in either file is kept and not computed again (a last frame cut off mid-write
is cut from the file first), so the run ends with the content an
uninterrupted one would have written (relaxations in another order; see
:func:`read_results` and :func:`sort_output`). Single points and MD evaluate
a chunk again whole when only part of it was written, and write only the
missing structures: the chunks, and so every number, are those of the
uninterrupted run (for MD with a seeded thermostat too, as long as the
budget is the same). Without ``resume`` an existing, non-empty output is
refused.

Job identity. Each frame written carries ``job_input``, ``job_model`` and
``job_run`` (:mod:`nvalchemi_ase.identity`: digests of the input structure,
the model and the algorithm with its parameters; not returned by
:func:`read_results`). With ``resume=True`` each input whose result is
already written is digested as it is read and compared with its frame's:
another structure, model or parameters raise
:class:`~nvalchemi_ase.identity.JobMismatchError` naming the input index and
the field, so results of two jobs are never mixed. Results read back for
indices past the inputs given are not returned. A damaged frame followed by
complete ones is set aside by frame number and its structure computed again.
"""

from __future__ import annotations

from nvalchemi_ase.runners._common import PROPERTIES
from nvalchemi_ase.runners.budget import Budget
from nvalchemi_ase.runners.chunks import imd, isingle_points, md, single_points
from nvalchemi_ase.runners.files import (
    failed_path,
    finished_indices,
    read_results,
    sort_output,
)
from nvalchemi_ase.runners.relaxation import OPTIMIZERS, irelax, relax
from nvalchemi_ase.runners.restart import RunStopped

__all__ = [
    "OPTIMIZERS",
    "PROPERTIES",
    "Budget",
    "RunStopped",
    "failed_path",
    "finished_indices",
    "imd",
    "irelax",
    "isingle_points",
    "md",
    "read_results",
    "relax",
    "single_points",
    "sort_output",
]
