"""Every private nvalchemi member this package touches, in one place.

nvalchemi 0.3 offers no public way to drive an engine one ASE step at a time,
to reuse a neighbour list it already built, or to hand an engine a state it
made. The few private members that takes are wrapped here and nowhere else;
:data:`PRIVATE_MEMBERS` lists each with the parameters it is called with, and
``tests/test_compat.py`` checks them against the installed nvalchemi, so an
upstream change (even in a 0.3.x patch release, which the ``<0.4`` pin lets
in) fails one named test instead of a physics test.

Subclass hooks that nvalchemi documents for writing a ``BaseDynamics``
(:data:`SUBCLASS_HOOKS`: ``_init_state``, ``_make_new_state``,
``_sync_state_to_batch``, ``self._state``) are used by ``nvalchemi_ase.engines``
as prescribed, on ``self`` only; they are listed here too so the same test
watches them. ``tests/test_compat.py`` also scans the package's attribute
names (``obj._x``, ``getattr(obj, "_x")``, ``obj.__dict__.get("_x")``,
class bodies) against nvalchemi's
installed source: a private nvalchemi member used anywhere else than here, or
used here without a line in :data:`PRIVATE_MEMBERS` /
:data:`PRIVATE_ATTRIBUTES`, fails it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from nvalchemi_ase._quiet import import_quietly

if TYPE_CHECKING:
    import torch
    from nvalchemi.data import Batch
    from nvalchemi.dynamics.base import BaseDynamics

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_MEMBERS",
    "SUBCLASS_HOOKS",
    "PrivateMember",
    "admit_engine_state",
    "carry_engine_state",
    "close_hooks",
    "eager_call",
    "empty_neighbor_rows",
    "engine_seed",
    "engine_state",
    "ensure_bookkeeping_fields",
    "ensure_substage_states",
    "frozen_category",
    "load_neighbor_hook_state",
    "make_state_batch",
    "masked_pre_update",
    "neighbor_hook_lists",
    "neighbor_hook_reference",
    "neighbor_hook_state",
    "neighbor_list_cutoff",
    "npt_kinetic_energies",
    "npt_operators",
    "npt_pressure_tensor",
    "npt_volumes",
    "open_hooks",
    "pipeline_batch_sources",
    "pipeline_hook_inner",
    "pipeline_policy",
    "pipeline_sources",
    "post_update_is_noop",
    "prime_engine",
    "promises_noop_post_update",
    "seed_neighbor_hook",
    "set_engine_seed",
    "set_neighbor_capacity",
    "write_neighbor_hook_lists",
]

_Class = TypeVar("_Class", bound=type)


class PrivateMember(NamedTuple):
    """One private nvalchemi member and how this package uses it."""

    module: str
    owner: str  # class name, or "" for a module-level function
    name: str
    parameters: tuple[str, ...]  # positional parameters after self, in order
    why: str


PRIVATE_MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_open_hooks",
        (),
        "enter context-manager hooks as run() does, without run()'s re-priming",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_close_hooks",
        (),
        "exit them again at the end of an ASE run",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_ensure_admission_initialized",
        ("batch",),
        "fire ON_ADMISSION once before ASE's initial evaluation",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_prime_forces",
        ("batch", "active_graph_mask"),
        "ASE's initial force evaluation (step 0) without a step",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "FusedStage",
        "_ensure_bookkeeping_fields",
        ("batch",),
        "FusedStage's status columns before the first step (relax + MD)",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_ensure_state_initialized",
        ("batch",),
        "a FusedStage sub-stage's state before its first step (fused restart)",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_init_state",
        ("batch",),
        "documented subclass hook: per-structure engine state",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_make_new_state",
        ("n", "template_batch"),
        "documented subclass hook: state for refilled structures",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_sync_state_to_batch",
        ("remaining_indices", "n_new", "template_batch"),
        "documented subclass hook: state after a refill",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops._bridge",
        "",
        "_make_state_batch",
        ("system_data", "device"),
        "the Batch an engine keeps its per-structure state in",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops.npt_nph",
        "",
        "npt_thermostat_half_step",
        (),  # a torch custom op: its signature reads (*args, **kwargs)
        "engines.mtk: one NHC half step per chain, each with its own length",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops.npt_nph",
        "",
        "npt_barostat_half_step",
        (),
        "engines.mtk: NPT's cell-velocity half step, as nvalchemi's NPT calls it",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops.npt_nph",
        "",
        "nph_velocity_half_step",
        (),
        "engines.mtk: NPT's force + strain velocity half step",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops.npt_nph",
        "",
        "npt_position_update",
        (),
        "engines.mtk: NPT's position update",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops.npt_nph",
        "",
        "npt_cell_update",
        (),
        "engines.mtk: NPT's cell update",
    ),
    PrivateMember(
        "nvalchemi.dynamics._ops.nose_hoover",
        "",
        "nhc_compute_masses",
        ("temperature", "thermostat_time", "masses", "batch_idx", "chain_length"),
        "engines.mtk: the barostat chain's masses for its own length",
    ),
    PrivateMember(
        "nvalchemi.dynamics.integrators.npt",
        "",
        "_cell_kinetic_energy",
        ("cell_velocity", "W", "pressure_coupling"),
        "engines.mtk: the cell's kinetic energy the barostat chain is driven by",
    ),
    PrivateMember(
        "nvalchemi.dynamics.integrators.npt",
        "",
        "_cell_dof_count",
        ("pressure_coupling",),
        "engines.mtk: the cell degrees of freedom of a coupling mode",
    ),
    PrivateMember(
        "nvalchemi.dynamics.integrators.npt",
        "NPT",
        "_compute_volumes",
        ("batch",),
        "engines.mtk: NPT's own volumes, inherited",
    ),
    PrivateMember(
        "nvalchemi.dynamics.integrators.npt",
        "NPT",
        "_compute_ke",
        ("batch",),
        "engines.mtk: NPT's own kinetic energies, inherited",
    ),
    PrivateMember(
        "nvalchemi.dynamics.integrators.npt",
        "NPT",
        "_compute_P",
        ("batch", "volumes"),
        "engines.mtk: NPT's own instantaneous pressure tensor, inherited",
    ),
    PrivateMember(
        "nvalchemi.data.level_storage",
        "SegmentedLevelStorage",
        "__init__",
        (),
        "build a Batch from stacked arrays in one pass (validate=False)",
    ),
    PrivateMember(
        "nvalchemi.models.base",
        "BaseModelMixin",
        "_validate_derivative_request",
        ("request",),
        "wrapper hook that admits analytic Hessians; properties.vibrations' tests "
        "override it on the demo model to check compute_hessian against finite "
        "differences",
    ),
    PrivateMember(
        "nvalchemi.dynamics.base",
        "BaseDynamics",
        "_masked_pre_update",
        ("batch", "mask"),
        "replay an L-BFGS trajectory into the engine for some structures only",
    ),
    PrivateMember(
        "nvalchemi.neighbors",
        "",
        "_write_neighbor_data_to_batch",
        (
            "batch",
            "neighbor_matrix",
            "num_neighbors",
            "neighbor_matrix_shifts",
            "format",
            "cutoff",
        ),
        "put a restored neighbour list back into the batch (exact restart), "
        "and one whose finished structures' rows were emptied (runners)",
    ),
)

# Attributes (not callables) read or written; checked on live objects.
PRIVATE_ATTRIBUTES = {
    "BaseDynamics": (
        "_admission_initialized",
        "_forces_primed",
        "_state",
        "_random_seed",  # read by state_dict() and load_state_dict()
        "_post_update_is_noop",  # a class attribute subclasses may set
    ),
    "Batch": (
        "_neighbor_list_cutoff",  # set by the neighbour-list writer
        "_pipeline_neighbor_sources",  # set by a composed model's pipeline hook
    ),
    "NeighborListHook": (
        "_ref_positions",
        "_neighbor_matrix",
        "_num_neighbors",
        "_neighbor_matrix_shifts",
        "_max_neighbors",
        "_max_neighbors_override",
        "_col_range",
    ),
    # models.composition: a composed model's planned neighbour-list sources,
    # and the inner hooks of its multi-source hook (swapped for eager ones).
    "PipelineModelWrapper": (
        "_neighbor_sources",
        "_neighbor_adaptation",
        "_max_cutoff_ratio",
    ),
    "_PipelineNeighborListHook": ("hooks", "sources"),
}


#: nvalchemi's documented subclass hooks of ``BaseDynamics``: the engines in
#: ``nvalchemi_ase.engines`` define, call (``super()``) and use them on
#: ``self`` as its docstrings prescribe; nothing else outside this module does.
SUBCLASS_HOOKS: tuple[str, ...] = (
    "_init_state",
    "_make_new_state",
    "_sync_state_to_batch",
    "_state",
)


def open_hooks(engine: BaseDynamics) -> None:
    """Enter the engine's context-manager hooks (what ``run()`` does first)."""
    engine._open_hooks()


def close_hooks(engine: BaseDynamics) -> None:
    """Exit the engine's context-manager hooks (what ``run()`` does last)."""
    engine._close_hooks()


def prime_engine(engine: BaseDynamics, batch: Batch, *, evaluate: bool = True) -> None:
    """Admit ``batch`` and evaluate the model once, before any step.

    ``ON_ADMISSION`` hooks fire, then ``BEFORE_COMPUTE`` → model →
    ``AFTER_COMPUTE`` with ``step_count`` unchanged, exactly as the first
    ``step()`` of ``run()`` would; the next ``step()`` then integrates without
    a second evaluation.

    ``evaluate=False``: the batch already holds the model outputs of its
    current positions (a refill evaluated only the structures it admitted),
    so the engine's ``compute`` is skipped for this one call (shadowed by a
    no-op on the instance, which ``_prime_forces`` calls); every hook stage
    runs as above.
    """
    engine._admission_initialized = False
    engine._ensure_admission_initialized(batch)
    mask = engine.active_graph_mask(batch, engine.exit_status)
    if evaluate:
        engine._prime_forces(batch, mask)
    else:
        engine.compute = _outputs_already_published  # type: ignore[method-assign]
        try:
            engine._prime_forces(batch, mask)
        finally:
            del engine.compute
    engine._forces_primed = True


def _outputs_already_published(
    batch: Batch, active_graph_mask: torch.Tensor | None = None
) -> None:
    """Stand-in for ``BaseDynamics.compute`` when the batch holds its outputs."""


def evaluate_again(engine: BaseDynamics, batch: Batch) -> None:
    """Evaluate the model at the batch's current positions, inside a step.

    ``BEFORE_COMPUTE`` (neighbour lists) → model → ``AFTER_COMPUTE``
    (constraints' force adjustment, failure checks), as at the start of a
    run, ``step_count`` unchanged: for an engine that moves and needs the
    forces there before it finishes its step (ASE's FIRE2 after a restart).
    """
    engine._prime_forces(batch, engine.active_graph_mask(batch, engine.exit_status))


def ensure_bookkeeping_fields(engine: BaseDynamics, batch: Batch) -> None:
    """Give ``batch`` the ``status`` (and per-stage counter) columns now."""
    engine._ensure_bookkeeping_fields(batch)


def ensure_substage_states(engine: Any, batch: Batch) -> None:
    """Build each sub-stage's lazy per-structure state of a ``FusedStage`` now.

    nvalchemi builds it at the first ``step``; a run continued from a checkpoint
    needs it right after priming, to load the saved state into it.
    """
    for _, sub_stage in engine.sub_stages:
        sub_stage._ensure_state_initialized(batch)


def pipeline_sources(model: Any) -> list[Any]:
    """Return the ``NeighborConfig`` of each neighbour-list source a pipeline planned.

    ``PipelineModelWrapper._neighbor_sources`` (its ``make_neighbor_hooks``
    builds one ``NeighborListHook`` per entry), largest cutoff first.
    """
    return [source.config for source in model._neighbor_sources]


def pipeline_policy(model: Any) -> dict[str, Any]:
    """Return a pipeline's neighbour-sharing arguments (``neighbor_adaptation``...).

    ``_neighbor_adaptation`` and ``_max_cutoff_ratio``, as keyword arguments
    for a new ``PipelineModelWrapper`` with the same policy.
    """
    return {
        "neighbor_adaptation": model._neighbor_adaptation,
        "max_cutoff_ratio": model._max_cutoff_ratio,
    }


def pipeline_batch_sources(batch: Batch) -> Any:
    """Return the sources a pipeline's neighbour hook left on ``batch``, or None.

    The tuple ``_PipelineNeighborListHook`` stores as the batch's
    ``_pipeline_neighbor_sources`` (compared by identity, never read).
    """
    return batch.__dict__.get("_pipeline_neighbor_sources")


def pipeline_hook_inner(hook: Any) -> list[Any]:
    """Return the inner ``NeighborListHook`` list of a ``_PipelineNeighborListHook``.

    The list object itself, one hook per source in the order of
    :func:`pipeline_sources`; replacing its entries changes how each source is
    built, while the pipeline hook still captures every source onto the batch.
    """
    inner: list[Any] = hook.hooks
    return inner


def eager_call(compiled: Any) -> Any:
    """Return the original function behind a ``torch.compile``-wrapped method."""
    return getattr(compiled, "_torchdynamo_orig_callable", compiled)


def neighbor_hook_reference(hook: Any) -> torch.Tensor | None:
    """Positions [V, 3] a ``NeighborListHook`` built its list at (None: not yet)."""
    return hook._ref_positions  # type: ignore[no-any-return]


def set_neighbor_capacity(hook: Any, capacity: int) -> None:
    """Make an unbuilt ``NeighborListHook`` start at ``capacity`` neighbours an atom.

    Instead of nvalchemi's density estimate; its first build still grows K
    when an atom has more neighbours, and never trims K below ``capacity``.
    """
    hook._max_neighbors_override = int(capacity)


def seed_neighbor_hook(
    hook: Any,
    matrix: torch.Tensor,
    num_neighbors: torch.Tensor,
    shifts: torch.Tensor | None,
    reference: torch.Tensor,
) -> None:
    """Give an unbuilt ``NeighborListHook`` a list to start from.

    ``matrix`` [V, K], ``num_neighbors`` [V], ``shifts`` [V, K, 3] (int32)
    and ``reference`` [V, 3] (positions the rows were built at, for the skin
    test) for the batch the hook will see. Its first call keeps the rows of
    every system whose atoms are within ``skin / 2`` of ``reference`` and
    builds the others (nvalchemi's per-system ``rebuild_flags``), then checks
    K as after any first build; K never drops below that of the lists given.
    """
    _set_hook_lists(hook, matrix, num_neighbors, shifts)
    hook._ref_positions = reference
    hook._max_neighbors_override = int(matrix.shape[1])


def neighbor_hook_lists(hook: Any) -> dict[str, torch.Tensor]:
    """Return the list a ``NeighborListHook`` holds (its own tensors, not copies).

    The keys of :func:`neighbor_hook_state`; read them, never write them.
    """
    if hook._neighbor_matrix is None:
        return {}
    lists = {"matrix": hook._neighbor_matrix, "num_neighbors": hook._num_neighbors}
    if hook._neighbor_matrix_shifts is not None:
        lists["shifts"] = hook._neighbor_matrix_shifts
    if hook._ref_positions is not None:
        lists["reference_positions"] = hook._ref_positions
    return lists


def neighbor_hook_state(hook: Any) -> dict[str, torch.Tensor]:
    """Return the list a ``NeighborListHook`` holds (copies), for a checkpoint.

    Returns
    -------
    dict of torch.Tensor
        ``matrix`` [V, K] and ``num_neighbors`` [V] (int32), and where they
        exist ``shifts`` [V, K, 3] (int32) and ``reference_positions`` [V, 3]
        Å (positions at the last build, for the skin test). Empty before the
        first build.
    """
    return {
        key: value.detach().clone() for key, value in neighbor_hook_lists(hook).items()
    }


def load_neighbor_hook_state(
    hook: Any, state: dict[str, torch.Tensor], batch: Batch
) -> None:
    """Give a built ``NeighborListHook`` the list of :func:`neighbor_hook_state`.

    The hook must have built a list for ``batch`` once (same atoms and
    systems), so its staging buffers exist; its list, neighbour capacity K and
    skin reference are replaced and the batch's neighbour fields rewritten, so
    the next evaluations sum the same pairs in the same order as the run that
    wrote the checkpoint.
    """
    device = hook._neighbor_matrix.device
    shifts = state.get("shifts")
    _set_hook_lists(
        hook,
        state["matrix"].to(device),
        state["num_neighbors"].to(device),
        None if shifts is None else shifts.to(device),
    )
    reference = state.get("reference_positions")
    if reference is not None:
        hook._ref_positions = reference.to(device)
    _write_hook_lists(hook, batch)


def empty_neighbor_rows(hook: Any, rows: torch.Tensor, batch: Batch) -> None:
    """Give the atoms ``rows`` of a built ``NeighborListHook`` no neighbours.

    Their rows of the [V, K] list are set to the fill value (``V``), their
    counts and shifts to 0, and the batch's neighbour fields rewritten (a COO
    list is converted from the matrix again). nvalchemi's selective rebuild
    leaves a system it does not flag untouched, so the rows stay empty until
    that system moves past the skin or the whole list is rebuilt.
    """
    if hook._neighbor_matrix is None:
        return
    hook._num_neighbors[rows] = 0
    hook._neighbor_matrix[rows] = batch.num_nodes
    if hook._neighbor_matrix_shifts is not None:
        hook._neighbor_matrix_shifts[rows] = 0
    _write_hook_lists(hook, batch)


def write_neighbor_hook_lists(hook: Any, batch: Batch) -> None:
    """Write a built ``NeighborListHook``'s list into ``batch``'s neighbour fields."""
    if hook._neighbor_matrix is not None:
        _write_hook_lists(hook, batch)


def _set_hook_lists(
    hook: Any,
    matrix: torch.Tensor,
    num_neighbors: torch.Tensor,
    shifts: torch.Tensor | None,
) -> None:
    """Make ``matrix`` [V, K], its counts and shifts a hook's list (K from it)."""
    hook._neighbor_matrix = matrix
    hook._num_neighbors = num_neighbors
    hook._neighbor_matrix_shifts = shifts
    hook._max_neighbors = int(matrix.shape[1])
    hook._col_range = _arange(int(matrix.shape[1]), matrix.device)


def _write_hook_lists(hook: Any, batch: Batch) -> None:
    """Write a hook's list into ``batch``'s neighbour fields (COO: converted)."""
    neighbors = import_quietly("nvalchemi.neighbors")
    neighbors._write_neighbor_data_to_batch(
        batch,
        hook._neighbor_matrix,
        hook._num_neighbors,
        hook._neighbor_matrix_shifts,
        hook.config.format,
        hook.config.cutoff,
    )


def _arange(count: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(count)`` as int32 on ``device`` (torch imported lazily)."""
    import torch

    return torch.arange(count, device=device, dtype=torch.int32)


def masked_pre_update(engine: BaseDynamics, batch: Batch, mask: torch.Tensor) -> None:
    """Run the engine's ``pre_update`` for the graphs in ``mask`` [B] only.

    Positions, velocities and the engine's state of the other graphs are put
    back afterwards (what ``FusedStage`` does with each sub-stage).
    """
    engine._masked_pre_update(batch, mask)


def make_state_batch(data: dict[str, torch.Tensor], device: torch.device) -> Batch:
    """Make the ``Batch`` an engine keeps per-structure state in (``_state``)."""
    bridge = import_quietly("nvalchemi.dynamics._ops._bridge")
    return bridge._make_state_batch(data, device)


@functools.cache
def npt_operators() -> Any:
    """Return nvalchemi 0.3's NPT operators, the ones its ``NPT`` engine calls.

    A namespace with the torch ops of ``nvalchemi.dynamics._ops.npt_nph``
    (``npt_thermostat_half_step``, ``npt_barostat_half_step``,
    ``nph_velocity_half_step``, ``npt_position_update``, ``npt_cell_update``),
    ``nhc_compute_masses`` (``_ops.nose_hoover``) and the two module-private
    helpers of ``nvalchemi.dynamics.integrators.npt``
    (``cell_kinetic_energy`` = ``_cell_kinetic_energy``, ``cell_dof_count`` =
    ``_cell_dof_count``). Arguments and units are nvalchemi's (kT in eV,
    times in the internal time unit).
    """
    from types import SimpleNamespace

    ops = import_quietly("nvalchemi.dynamics._ops.npt_nph")
    nose_hoover = import_quietly("nvalchemi.dynamics._ops.nose_hoover")
    integrator = import_quietly("nvalchemi.dynamics.integrators.npt")
    return SimpleNamespace(
        npt_thermostat_half_step=ops.npt_thermostat_half_step,
        npt_barostat_half_step=ops.npt_barostat_half_step,
        nph_velocity_half_step=ops.nph_velocity_half_step,
        npt_position_update=ops.npt_position_update,
        npt_cell_update=ops.npt_cell_update,
        nhc_compute_masses=nose_hoover.nhc_compute_masses,
        cell_kinetic_energy=integrator._cell_kinetic_energy,
        cell_dof_count=integrator._cell_dof_count,
    )


def engine_state(engine: BaseDynamics) -> Batch | None:
    """Return an engine's per-structure state (``self._state``), or None before it.

    Rows are structures; nvalchemi's integrators keep thermostat and barostat
    variables there (e.g. ``NVTNoseHoover``: ``nhc_eta``, ``nhc_eta_dot``,
    ``nhc_Q`` [B, chain], ``temperature`` (kT, eV), ``nhc_ndof`` [B]).
    """
    return getattr(engine, "_state", None)


def engine_seed(engine: BaseDynamics) -> int | None:
    """Return an engine's noise seed (``_random_seed``), or None without one.

    nvalchemi's ``state_dict`` saves this attribute as ``random_seed`` and
    ``load_state_dict`` restores it when the engine has one, as ``NVTLangevin``
    keeps its seed.
    """
    return getattr(engine, "_random_seed", None)


def set_engine_seed(engine: BaseDynamics, seed: int) -> None:
    """Give an engine the noise seed ``state_dict`` saves (``_random_seed``)."""
    engine._random_seed = int(seed)  # type: ignore[attr-defined]


def post_update_is_noop(cls: _Class) -> _Class:
    """Class decorator: promise nvalchemi that ``cls.post_update`` does nothing.

    Sets ``BaseDynamics._post_update_is_noop`` on ``cls``, so the masked
    ``post_update`` of a ``FusedStage`` skips saving and restoring every
    mutable field around it. Only for engines whose ``post_update`` reads and
    writes nothing.
    """
    setattr(cls, "_post_update_is_noop", True)  # noqa: B010 - the scan reads it
    return cls


def promises_noop_post_update(engine: BaseDynamics) -> bool:
    """Whether ``engine``'s class promises a ``post_update`` that does nothing."""
    return bool(getattr(type(engine), "_post_update_is_noop", False))


def npt_volumes(engine: Any, batch: Batch) -> torch.Tensor:
    """Cell volumes [B] Å³ as an ``NPT`` engine computes them (``_compute_volumes``)."""
    return engine._compute_volumes(batch)


def npt_kinetic_energies(engine: Any, batch: Batch) -> torch.Tensor:
    """Kinetic energies [B], as an ``NPT`` engine computes them (``_compute_ke``).

    Units are nvalchemi's internal ones (eV with its internal time unit).
    """
    return engine._compute_ke(batch)


def npt_pressure_tensor(
    engine: Any, batch: Batch, volumes: torch.Tensor
) -> torch.Tensor:
    """Instantaneous pressure tensors [B, 3, 3] of an ``NPT`` engine (``_compute_P``).

    ``volumes`` [B] Å³ (:func:`npt_volumes`); it also fills the engine's
    ``kinetic_tensors`` and ``pressure_tensors`` state, as ``NPT`` does.
    """
    return engine._compute_P(batch, volumes)


def neighbor_list_cutoff(batch: Batch) -> float | None:
    """Cutoff (Å) the batch's neighbour list was built with, or None if unknown.

    nvalchemi's neighbour-list writer records it as ``batch._neighbor_list_cutoff``.
    """
    cutoff = getattr(batch, "_neighbor_list_cutoff", None)
    return None if cutoff is None else float(cutoff)


def frozen_category() -> int:
    """Return the atom category nvalchemi freezes (``AtomCategory.SPECIAL``)."""
    typing = import_quietly("nvalchemi._typing")
    return int(typing.AtomCategory.SPECIAL.value)


def carry_engine_state(
    old: BaseDynamics,
    new: BaseDynamics,
    remaining: torch.Tensor,
    n_new: int,
    template_batch: Batch,
) -> None:
    """Hand ``new`` the per-structure state of ``old`` after a refill.

    ``old._sync_state_to_batch`` (what nvalchemi's ``refill_check`` calls) keeps
    the rows of the ``remaining`` structures, in order, and appends
    ``_make_new_state`` rows for ``n_new`` structures admitted after them in
    ``template_batch``; the result becomes ``new._state``, so ``new`` never
    initialises fresh state for the survivors. ``old`` must not be stepped
    again. Nothing is carried when ``old`` never built state.
    """
    if not hasattr(old, "_state"):
        return
    old._sync_state_to_batch(remaining, n_new, template_batch)
    if hasattr(old, "_state"):
        new._state = old._state


def admit_engine_state(
    engine: BaseDynamics,
    remaining: torch.Tensor,
    n_new: int,
    template_batch: Batch,
    fresh: BaseDynamics,
) -> None:
    """Keep ``engine``'s state rows ``remaining`` and append ``fresh``'s for arrivals.

    ``fresh`` is an engine of the same class built with the per-structure
    parameters of every structure of ``template_batch`` (the kept ones, in
    order, then ``n_new`` arrivals); its ``_init_state(template_batch)`` gives
    each arrival the state it would start with alone (for ``NVTNoseHoover``
    its own chain masses and degrees of freedom, which ``_make_new_state``
    only approximates). An ``engine`` that never built state takes all of
    ``fresh``'s rows.
    """
    fresh._init_state(template_batch)
    rows = fresh._state
    if hasattr(engine, "_state") and remaining.numel():
        kept = engine._state.index_select(remaining)
        if n_new:
            first = template_batch.num_graphs - n_new
            arrivals = remaining.new_tensor(range(first, template_batch.num_graphs))
            kept.append(rows.index_select(arrivals))
        rows = kept
    engine._state = rows
