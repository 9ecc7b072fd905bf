"""One batched run: the working batch and everything stepped with it.

A :class:`BatchRun` owns the nvalchemi ``Batch`` the engine evolves in place,
the engine and its per-structure state, the failure guard, the neighbour-list
hooks (registered on the engine), nvalchemi's ``status`` column, the step
whose evaluation computed the batch's stress, and priming (the one evaluation
before the first step). It can take structures in (:meth:`admit`) and let
structures go (:meth:`retire`) in place, as nvalchemi's own pipeline stages
resize their active batch (``Batch.append`` / ``Batch.index_select`` and the
engine's ``_sync_state_to_batch``), and it gives its state as plain arrays
(:meth:`capture`) and takes it back (:meth:`restore_structures`,
:meth:`restore_engine`), which is all a checkpoint
(:mod:`nvalchemi_ase.dynamics.checkpoint`) needs of it.

It knows nothing of ASE: the ``Atoms`` mirror, observers, logs and
trajectories belong to the ASE-facing classes
(:class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`) and the runners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase._compat import admit_engine_state, carry_engine_state, engine_state
from nvalchemi_ase.dynamics.checkpoint import (
    BATCH_FIELDS,
    RESULT_FIELDS,
    STATUS_FIELD,
    Checkpoint,
    CheckpointError,
    checkpoint_fix,
    host_array,
    put_array,
)
from nvalchemi_ase.dynamics.driver import EngineDriver
from nvalchemi_ase.dynamics.failures import FailureGuard
from nvalchemi_ase.dynamics.neighbors import (
    adopt_neighbor_lists,
    append_neighbor_lists,
    build_lists_apart,
    carry_neighbor_lists,
    empty_neighbors,
    is_neighbor_hook,
    lists_build_apart,
    load_neighbor_state,
    neighbor_fields,
    neighbor_state,
)

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.dynamics.base import BaseDynamics

__all__ = ["BatchRun", "atom_rows"]


@dataclass
class _Arrivals:
    """Structures :meth:`BatchRun.resize` admitted, not evaluated yet."""

    batch: Batch | None  # the admitted structures alone, as appended (None: none)
    first_graph: int  # where they start in the working batch
    first_atom: int


class BatchRun:
    """The working batch of a run and what steps it, resizable in place.

    Parameters
    ----------
    batch : nvalchemi.data.Batch
        The structures, as :func:`~nvalchemi_ase.convert.atoms_to_batch`
        built them (positions Å, velocities in nvalchemi's units, cells Å).
    guard : FailureGuard
        The failure flags of ``batch``'s structures; its hooks are among the
        engine's.

    Notes
    -----
    The engine is built by the caller with this run's hooks (the guard's
    first, then the neighbour-list hooks) and handed over with
    :meth:`attach_engine`, because building it may read the batch.
    """

    def __init__(self, batch: Batch, guard: FailureGuard) -> None:
        self.batch = batch
        self.guard = guard
        self.engine: BaseDynamics = None  # type: ignore[assignment]
        self.driver: EngineDriver | None = None
        self._neighbor_hooks: Callable[[], list[Any]] | None = None
        #: The step whose evaluation computed the batch's stress (-1: none).
        self.stress_step = -1
        #: Whether the current batch has been evaluated (priming done).
        self.primed = False
        #: Model outputs of the batch's latest evaluation (None: none yet).
        self._evaluated: frozenset[str] | None = None
        self._arrivals: _Arrivals | None = None

    def attach_engine(
        self,
        engine: BaseDynamics,
        neighbor_hooks: Callable[[], list[Any]] | None = None,
    ) -> None:
        """Take the engine that evolves :attr:`batch` (built with this run's hooks).

        ``neighbor_hooks`` makes fresh neighbour-list hooks like the engine's
        (:func:`~nvalchemi_ase.dynamics.neighbors.neighbor_hooks`), for
        :meth:`resize`.
        """
        self.engine = engine
        self.driver = EngineDriver(engine, self.batch)
        self._neighbor_hooks = neighbor_hooks

    @property
    def size(self) -> int:
        """Number of structures in the batch."""
        return int(self.batch.num_graphs)

    def neighbor_hooks(self) -> list[Any]:
        """Return the engine's neighbour-list hooks, in registration order."""
        return [hook for hook in self.engine.hooks if is_neighbor_hook(hook)]

    # -- stepping -------------------------------------------------------------------

    def open_hooks(self) -> bool:
        """Enter the engine's context-manager hooks (as nvalchemi's ``run()`` does).

        Returns
        -------
        bool
            Whether this call entered them (False: they were open already).
        """
        assert self.driver is not None  # noqa: S101 - attach_engine came first
        return self.driver.open()

    def close_hooks(self) -> None:
        """Exit the engine's context-manager hooks."""
        assert self.driver is not None  # noqa: S101 - attach_engine came first
        self.driver.close()

    def prime(self) -> None:
        """Evaluate the batch once before any step (ASE's first ``get_forces``).

        The caller chooses the model outputs (``model.narrowed_outputs``).
        After :meth:`resize` the model evaluates only the admitted structures
        (their own batch, their own neighbour lists, which then join the
        working lists; none if none was admitted), when the structures that
        stayed hold every output asked for now from their latest evaluation;
        every hook stage still runs over the whole batch, as in any priming.
        """
        self.engine.check_initial_batch(self.batch)
        self.guard.forget_snapshot()
        assert self.driver is not None  # noqa: S101 - attach_engine came first
        arrivals, self._arrivals = self._arrivals, None
        outputs = self._outputs()
        apart = (
            arrivals is not None
            and self._evaluated is not None
            and outputs <= self._evaluated
            and lists_build_apart(self.engine.hooks)
        )
        if apart:
            assert arrivals is not None  # noqa: S101 - checked just above
            self._evaluate_apart(arrivals)
            self.driver.prime(evaluate=False)
        else:
            self.driver.prime()
        self._evaluated = outputs

    def step(self) -> None:
        """One engine step over every active structure (all hook stages)."""
        assert self.driver is not None  # noqa: S101 - attach_engine came first
        self.driver.step()
        self._evaluated = self._outputs()

    def _outputs(self) -> frozenset[str]:
        """Return the model outputs an evaluation now computes (``active_outputs``)."""
        return frozenset(self.engine.model.model_config.active_outputs)

    def _evaluate_apart(self, arrivals: _Arrivals) -> None:
        """Evaluate the admitted structures alone; put outputs and lists in the batch.

        The survivors keep the outputs of their latest evaluation, at the
        positions they still have, and their lists (carried by :meth:`resize`).
        """
        assert self._neighbor_hooks is not None  # noqa: S101 - resize needs them
        alone, working = arrivals.batch, self.neighbor_hooks()
        if alone is None:  # structures retired, none admitted: nothing to evaluate
            adopt_neighbor_lists(working, self.batch)
            return
        lists = self._neighbor_hooks()
        build_lists_apart(lists, working, alone)
        self.engine.compute(alone)
        batch = self.batch
        with torch.no_grad():
            for key in RESULT_FIELDS:
                if key in alone and key in batch:
                    rows = (
                        arrivals.first_atom
                        if batch[key].shape[0] == batch.num_nodes
                        else arrivals.first_graph
                    )
                    batch[key][rows:].copy_(alone[key])
        append_neighbor_lists(working, lists, batch, arrivals.first_atom)

    # -- resizing -------------------------------------------------------------------

    def empty_neighbors(self, structures: npt.NDArray[np.bool_]) -> None:
        """Stop evaluating ``structures`` [B] (done, staying until retired).

        Their atoms keep no neighbours (see
        :func:`~nvalchemi_ase.dynamics.neighbors.empty_neighbors`), so the
        model spends next to nothing on them while they wait.
        """
        if structures.any():
            empty_neighbors(self.engine.hooks, self.batch, torch.as_tensor(structures))

    def carry_from(
        self, previous: BatchRun, kept: npt.NDArray[np.intp], n_new: int
    ) -> None:
        """Continue ``previous``'s structures ``kept``, which lead this run's batch.

        For a run built over ``kept`` of ``previous`` (in that order) followed
        by ``n_new`` new structures, before its first evaluation: the engine
        takes the kept structures' per-structure state (and fresh rows for the
        new ones) from ``previous``'s engine, which must not step again; the
        neighbour lists start from the kept structures' lists; the kept
        structures' velocities are copied. Each kept structure then goes on
        exactly as it would have in ``previous``.
        """
        device = previous.batch.device
        remaining = torch.as_tensor(
            np.asarray(kept, dtype=np.int64), dtype=torch.long, device=device
        )
        carry_neighbor_lists(
            previous.engine.hooks,
            self.engine.hooks,
            previous.batch,
            remaining,
            self.batch,
        )
        carry_engine_state(previous.engine, self.engine, remaining, n_new, self.batch)
        if not remaining.numel():
            return
        rows = atom_rows(previous.batch, remaining)
        with torch.no_grad():
            self.batch.velocities[: rows.numel()].copy_(
                previous.batch.velocities.index_select(0, rows)
            )

    def resize(
        self,
        keep: npt.NDArray[np.intp],
        arrivals: Batch | None,
        *,
        fresh_engine: BaseDynamics | None = None,
    ) -> None:
        """Keep the structures ``keep`` (in order) and append ``arrivals``, in place.

        The engine stays: its per-structure state keeps the kept structures'
        rows and gains fresh rows for the arrivals (nvalchemi's
        ``_sync_state_to_batch``, what its pipeline stages call when they
        resize); the kept structures' neighbour lists are carried, renumbered,
        and the arrivals' built at the next evaluation; the failure flags
        follow. The arrivals are not evaluated: call :meth:`prime` (or let
        the caller's priming run) before the next step; it evaluates them
        alone when it can (see :meth:`prime`).

        Parameters
        ----------
        keep : numpy.ndarray of int
            Positions of the structures that stay, in the order they lead the
            new batch.
        arrivals : Batch, optional
            The admitted structures (same device, dtype and fields), after
            them.
        fresh_engine : BaseDynamics, optional
            An engine of the same class built with the per-structure
            parameters of the resized batch (kept structures, then arrivals):
            the arrivals' state rows are its initial state, as each would
            start alone (the thermostats, whose engines size their parameters
            at construction). Without it the engine makes the new rows itself
            (``_make_new_state``, from its construction parameters).
        """
        old = self.batch
        device = old.device
        kept = torch.as_tensor(np.asarray(keep, dtype=np.int64), device=device)
        parts = []
        if kept.numel():
            # the lists are carried below and written again when the batch is
            # next evaluated: copying them here would cost more than the rest
            # of the resize (3904 LJ atoms: 10.6 against 0.9 ms, append 6.0
            # against 0.5 ms)
            parts.append(old.index_select(kept, drop=neighbor_fields(old)))
        if arrivals is not None and arrivals.num_graphs:
            parts.append(arrivals)
        if not parts:
            raise ValueError("a run cannot be resized to no structure")
        new = parts[0]
        for part in parts[1:]:
            new.append(part, missing_fields="fill")
        n_new = 0 if arrivals is None else int(arrivals.num_graphs)
        self._carry_neighbor_lists_in_place(old, kept, new)
        if fresh_engine is None:
            carry_engine_state(self.engine, self.engine, kept, n_new, new)
        else:
            admit_engine_state(self.engine, kept, n_new, new, fresh_engine)
        self.guard.resize(kept, new)
        self.batch = new
        assert self.driver is not None  # noqa: S101 - attach_engine came first
        self.driver.batch = new
        self.primed = False
        self.stress_step = -1
        self._arrivals = None
        if kept.numel():  # else the whole batch is new: evaluated whole
            admitted = arrivals if n_new else None
            new_atoms = 0 if admitted is None else int(admitted.num_nodes)
            self._arrivals = _Arrivals(
                admitted, int(kept.numel()), int(new.num_nodes) - new_atoms
            )

    def _carry_neighbor_lists_in_place(
        self, old: Batch, kept: torch.Tensor, new: Batch
    ) -> None:
        """Fresh neighbour-list hooks for ``new``, seeded with the kept rows."""
        if self._neighbor_hooks is None:
            raise RuntimeError("attach_engine(..., neighbor_hooks=) enables resize")
        hooks = self.engine.hooks
        previous = list(hooks)
        fresh = iter(self._neighbor_hooks())
        for position, hook in enumerate(hooks):
            if is_neighbor_hook(hook):
                hooks[position] = next(fresh)
        carry_neighbor_lists(previous, hooks, old, kept, new)

    # -- capture and restore --------------------------------------------------------

    def capture(self) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
        """Return the state the next step reads, as host arrays.

        Returns
        -------
        counters : dict
            ``engine_step_count``, ``random_seed`` (None for a deterministic
            engine) and ``stress_step``.
        arrays : dict of numpy.ndarray
            ``batch/<field>`` (positions, velocities, cell, status, model
            outputs), ``engine/<field>`` (the engine's ``state_dict()``),
            ``failures/<field>`` and ``neighbors/<i>/<field>``.
        """
        batch = self.batch
        arrays: dict[str, npt.NDArray[Any]] = {}
        for key in (*BATCH_FIELDS, STATUS_FIELD, *RESULT_FIELDS):
            if key in batch:
                arrays[f"batch/{key}"] = host_array(batch[key])
        state = self.engine.state_dict()
        for key, value in state.get("state", {}).items():
            arrays[f"engine/{key}"] = host_array(value)
        for key, value in self.guard.state().items():
            arrays[f"failures/{key}"] = host_array(value)
        for index, hook in enumerate(self.neighbor_hooks()):
            for key, value in neighbor_state(hook).items():
                arrays[f"neighbors/{index}/{key}"] = host_array(value)
        seed = state.get("random_seed")
        counters = {
            "engine_step_count": int(state.get("step_count", 0)),
            "random_seed": None if seed is None else int(seed),
            "stress_step": int(self.stress_step),
        }
        return counters, arrays

    def restore_structures(self, checkpoint: Checkpoint) -> None:
        """Take a checkpoint's positions, velocities, cells and failure flags.

        The engine's state and the model outputs follow after the priming
        evaluation (:meth:`restore_engine`), once the engine has built its
        state.
        """
        batch = self.batch
        saved = checkpoint.group("batch")
        with torch.no_grad():
            for key in BATCH_FIELDS:
                if key not in saved:
                    raise CheckpointError(
                        f"restart file {checkpoint.path}: field 'batch/{key}' is "
                        f"missing; {checkpoint_fix()}"
                    )
                put_array(batch, key, saved[key], checkpoint.path)
        self.guard.load_state(
            {
                key: torch.as_tensor(value, device=batch.device)
                for key, value in checkpoint.group("failures").items()
            }
        )
        seed = checkpoint.meta.get("random_seed")
        if seed is not None and isinstance(
            getattr(type(self.engine), "random_seed", None), property
        ):
            self.engine.random_seed = int(seed)

    def restore_engine(self, checkpoint: Checkpoint) -> None:
        """Give the primed engine its checkpointed state, list and model outputs.

        Called once, right after the evaluation that primes the continued run
        (which builds the engine's state and a neighbour list), before any step.

        Raises
        ------
        CheckpointError
            If the engine's state has other fields or shapes than the checkpoint's.
        """
        batch, engine, path = self.batch, self.engine, checkpoint.path
        saved = checkpoint.group("engine")
        fit = getattr(engine, "fit_checkpoint_state", None)
        if fit is not None:  # padded state: a refilled batch's may be wider
            fit(saved)
        live = {key: value for key, value in engine_state(engine) or ()}
        if set(saved) != set(live):
            raise CheckpointError(
                f"restart file {path}: field 'engine' holds {sorted(saved)} but this "
                f"{type(engine).__name__} holds {sorted(live)}; {checkpoint_fix()}"
            )
        for key, value in saved.items():
            if tuple(value.shape) != tuple(live[key].shape):
                raise CheckpointError(
                    f"restart file {path}: engine field {key!r} has shape "
                    f"{tuple(value.shape)} in the checkpoint but "
                    f"{tuple(live[key].shape)} here (e.g. another history size); "
                    + checkpoint_fix()
                )
        state: dict[str, Any] = {
            "step_count": int(checkpoint.meta.get("engine_step_count", 0)),
            "state": {
                key: torch.as_tensor(value, device=batch.device).to(live[key].dtype)
                for key, value in saved.items()
            },
        }
        if checkpoint.meta.get("random_seed") is not None:
            state["random_seed"] = int(checkpoint.meta["random_seed"])
        engine.load_state_dict(state)
        self.stress_step = int(checkpoint.meta.get("stress_step", -1))
        results = checkpoint.group("batch")
        with torch.no_grad():
            if STATUS_FIELD in results:
                put_array(batch, STATUS_FIELD, results[STATUS_FIELD], path)
            elif STATUS_FIELD in batch:
                batch[STATUS_FIELD].zero_()
        if not _holds(batch, results):
            return  # the caller moved the structures since: fresh list and outputs
        for index, hook in enumerate(self.neighbor_hooks()):
            fields = checkpoint.group(f"neighbors/{index}")
            load_neighbor_state(
                hook,
                {
                    key: torch.as_tensor(value, device=batch.device)
                    for key, value in fields.items()
                },
                batch,
            )
        with torch.no_grad():
            for key in RESULT_FIELDS:
                if key in results and key in batch:
                    put_array(batch, key, results[key], path)


def atom_rows(batch: Any, graphs: torch.Tensor) -> torch.Tensor:
    """Atom rows of ``graphs`` (long, in that order), concatenated."""
    pointer = batch.batch_ptr
    starts = pointer.index_select(0, graphs)
    sizes = pointer.index_select(0, graphs + 1) - starts
    first = torch.cumsum(sizes, 0) - sizes  # where each graph starts among the rows
    total = int(sizes.sum())
    offsets = torch.repeat_interleave(starts - first, sizes)
    return torch.arange(total, device=pointer.device, dtype=offsets.dtype) + offsets


def _holds(batch: Any, saved: dict[str, npt.NDArray[Any]]) -> bool:
    """Whether the batch still has the checkpoint's positions and cells."""
    return all(
        key in saved and np.array_equal(host_array(batch[key]), saved[key])
        for key in ("positions", "cell")
    )
