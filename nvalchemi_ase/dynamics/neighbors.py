"""Neighbour lists for the dynamics engines: nvalchemi's hook, eager and skin-aware.

The hook is nvalchemi's ``NeighborListHook`` run without ``torch.compile``, and
skipped outright while its Verlet skin still holds.

nvalchemi's ``NeighborListHook`` keeps a list built to ``cutoff + skin`` and, per
system, rebuilds only where an atom moved more than ``skin / 2``. Even when no
system needs it, every call still re-stages the inputs, launches the list kernel,
re-marks stale entries and rewrites the batch's neighbour fields (a COO list is
re-converted from the matrix): about a quarter of an LJ step on a CPU. The hook
here answers "nothing moved enough" first and then does nothing, and otherwise
runs nvalchemi's own call unchanged. The check reads one number back to the host,
which is free on a CPU; on an accelerator it would be a synchronisation per step,
so there nvalchemi's own (sync-free) path always runs.

A composed model (nvalchemi's ``PipelineModelWrapper``) that plans several
lists (e.g. SevenNet-0's 5 Å and D3's 15 Å) gets the pipeline's own hook from
its ``make_neighbor_hooks()``, which builds every list and leaves them all on
the batch for the pipeline's forward, with one eager skin hook per list inside
it; the skip applies to the whole (every list holds, or all go to nvalchemi's
per-system rebuild). Emptying finished structures, carrying lists into a
refilled batch and checkpoints work per list.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase import devices
from nvalchemi_ase._compat import (
    eager_call,
    empty_neighbor_rows,
    load_neighbor_hook_state,
    neighbor_hook_lists,
    neighbor_hook_reference,
    neighbor_hook_state,
    pipeline_batch_sources,
    pipeline_hook_inner,
    seed_neighbor_hook,
    set_neighbor_capacity,
    write_neighbor_hook_lists,
)
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.models.composition import composed_parts, neighbor_hook_for

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "PipelineNeighborHook",
    "adopt_neighbor_lists",
    "append_neighbor_lists",
    "build_lists_apart",
    "carry_neighbor_lists",
    "empty_neighbors",
    "is_neighbor_hook",
    "lists_build_apart",
    "load_neighbor_state",
    "neighbor_fields",
    "neighbor_hooks",
    "neighbor_state",
]


def neighbor_hooks(model: BaseModelMixin, skin: float) -> list[Any]:
    """Neighbour-list hooks for ``model`` with a Verlet skin.

    nvalchemi's ``NeighborListHook.__call__`` is wrapped in ``torch.compile``;
    on the CPU that costs about a second of compilation per new batch shape
    and buys nothing (step times are the same with ``TORCHDYNAMO_DISABLE=1``),
    so the hook's own, uncompiled function is used, behind the skip
    described in the module docstring.

    Parameters
    ----------
    model : BaseModelMixin
        The model whose ``NeighborConfig`` (cutoff, format, half list) is used.
    skin : float
        Verlet skin, Å: the list is built to ``cutoff + skin`` and rebuilt only
        when an atom moved more than ``skin / 2`` since the last build. A list
        read whole by D3 (whose coordination numbers sum every listed pair)
        takes no skin: it is rebuilt exactly at the cutoff every step.

    Returns
    -------
    list
        One ``NeighborListHook`` at ``BEFORE_COMPUTE``, or none when the model
        needs no neighbour list. Its ``builds`` attribute counts the calls that
        reached nvalchemi's list code.
    """
    stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
    exact = [
        part.model_config.neighbor_config.cutoff
        for part in composed_parts(model)
        if _needs_exact_list(part)
    ]

    def make(config: Any) -> Any:
        own = 0.0 if any(abs(c - config.cutoff) < 1e-6 for c in exact) else skin
        return _skipping_hook_class()(config, skin=own, stage=stages.BEFORE_COMPUTE)

    pipeline_hook = neighbor_hook_for(model, make)
    if pipeline_hook is not None:
        return [PipelineNeighborHook(pipeline_hook, skin)]
    config = model.model_config.neighbor_config
    if config is None:
        return []
    return [make(config)]


def _needs_exact_list(model: Any) -> bool:
    """Whether ``model`` reads every listed pair, so its list takes no skin.

    nvalchemiops' D3 kernel counts coordination numbers over every neighbour
    in the list, with no cutoff of its own: a list built to ``cutoff + skin``
    would change its energies (1e-6 Å over ten MD steps of a Cu slab).
    """
    return model.model_config.neighbor_config is not None and any(
        cls.__name__ == "DFTD3ModelWrapper" for cls in type(model).__mro__
    )


def is_neighbor_hook(hook: object) -> bool:
    """Whether ``hook`` is a neighbour-list hook made by :func:`neighbor_hooks`."""
    return isinstance(hook, _skipping_hook_class() | PipelineNeighborHook)


class PipelineNeighborHook:
    """A composed model's neighbour hook (nvalchemi's), skipped while its skin holds.

    Parameters
    ----------
    pipeline_hook : object
        The hook of the model's ``make_neighbor_hooks()`` (it builds every
        planned list and leaves them on the batch), its inner hooks made by
        :func:`neighbor_hooks` (one per list, skin ``skin``).
    skin : float
        Verlet skin, Å.

    Attributes
    ----------
    lists : list
        The inner hooks, one per list, largest cutoff first.
    builds : int
        Calls that reached nvalchemi's hook.
    """

    def __init__(self, pipeline_hook: Any, skin: float) -> None:
        self.pipeline = pipeline_hook
        self.lists: list[Any] = pipeline_hook_inner(pipeline_hook)
        for inner in self.lists:
            inner.skip_when_holding = False  # decided here, for all lists at once
        self.skin = skin
        self.stage = pipeline_hook.stage
        self.frequency = 1
        self.builds = 0
        self._written: Any = None

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Build every list (nvalchemi's hook) unless all still hold for the batch."""
        batch = ctx.batch
        if (
            self._written is not None
            and pipeline_batch_sources(batch) is self._written
            and all(_within_skin(inner, batch) for inner in self.lists)
        ):
            return
        self.pipeline(ctx, stage)
        self.builds += 1
        self._written = pipeline_batch_sources(batch)

    def rewrite(self, batch: Batch) -> None:
        """Put the inner hooks' current lists on ``batch`` again, none rebuilt."""
        for inner in self.lists:
            inner.hold = True
        try:
            self.pipeline(SimpleNamespace(batch=batch), self.stage)
        finally:
            for inner in self.lists:
                inner.hold = False
        self._written = pipeline_batch_sources(batch)


def _list_hooks(hooks: list[Any]) -> list[Any]:
    """Return the hooks holding one list each (a composed model's, each of its)."""
    flat: list[Any] = []
    for hook in hooks:
        if isinstance(hook, PipelineNeighborHook):
            flat += hook.lists
        elif is_neighbor_hook(hook):
            flat.append(hook)
    return flat


@functools.cache
def _skipping_hook_class() -> type:
    base: Any = import_quietly("nvalchemi.hooks").NeighborListHook
    compiled_call = base.__call__
    eager = eager_call(compiled_call)

    class SkinNeighborListHook(base):  # type: ignore[misc,valid-type]
        """nvalchemi's ``NeighborListHook``, eager, skipped while its skin holds."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.builds = 0
            self._written: torch.Tensor | None = None
            self._cell_at_build: torch.Tensor | None = None
            #: Atom rows kept empty (:func:`empty_neighbors`), or None.
            self.emptied: torch.Tensor | None = None
            #: False inside a composed model's hook, which decides for all lists.
            self.skip_when_holding = True
            #: True while a composed model's hook rewrites lists (none rebuilt).
            self.hold = False
            #: (atoms, structures) of the batch its list was made for.
            self.sizes: tuple[int, int] | None = None

        def __call__(self, ctx: Any, stage: Any) -> None:
            batch = ctx.batch
            if self.hold:
                write_neighbor_hook_lists(self, batch)
                return
            if self.skip_when_holding and _list_still_holds(self, batch):
                return
            eager(self, ctx, stage)
            self.builds += 1
            if self.emptied is not None:  # a rebuild may have refilled them
                empty_neighbor_rows(self, self.emptied, batch)
            self.adopt(batch, write=False)

        def adopt(self, batch: Any, *, write: bool = True) -> None:
            """Take the list it holds as exact for ``batch``: written there, kept.

            Until an atom moves past half the skin (or the cells or sizes
            change), its calls leave the list as it is.
            """
            if write:
                write_neighbor_hook_lists(self, batch)
            self._written = _neighbor_data(batch)
            self._cell_at_build = _cell_of(batch)
            self.sizes = (int(batch.num_nodes), int(batch.num_graphs))

    return SkinNeighborListHook


def empty_neighbors(hooks: list[Any], batch: Batch, systems: torch.Tensor) -> None:
    """Stop evaluating the interactions of some structures of ``batch``.

    Their atoms keep no neighbours in the lists of ``hooks`` from now on (also
    after later rebuilds), so a model that sums over the list spends next to
    nothing on them; their energies and forces become those of isolated atoms
    (zero for LJ). For structures that are done but stay in the batch until
    it is rebuilt: a runner's finished structures, whose results were already
    read. The other structures' lists, and so their results, are unchanged.

    Parameters
    ----------
    hooks : list
        An engine's hooks; those made by :func:`neighbor_hooks` are changed.
    batch : Batch
        The batch the hooks built their lists for.
    systems : torch.Tensor
        [B] bool: the structures to leave out.
    """
    rows = torch.nonzero(systems.to(batch.device)[batch.batch_idx.long()]).squeeze(1)
    if rows.numel() == 0:
        return
    for hook in _list_hooks(hooks):
        hook.emptied = rows if hook.emptied is None else torch.cat([hook.emptied, rows])
        empty_neighbor_rows(hook, rows, batch)
        hook._written = _neighbor_data(batch)
    for hook in hooks:
        if isinstance(hook, PipelineNeighborHook):
            hook.rewrite(batch)


def carry_neighbor_lists(
    old_hooks: list[Any],
    new_hooks: list[Any],
    old_batch: Batch,
    kept: torch.Tensor,
    new_batch: Batch,
) -> None:
    """Start a refilled batch's neighbour lists from the survivors' lists.

    A runner's refill builds a new engine over the structures ``kept`` of
    ``old_batch`` (in order, first) followed by the admitted ones. Left alone,
    the new engine's first evaluation builds every list again (about 30 ms
    for 4096 LJ argon atoms on a CPU, four LJ evaluations), although nothing
    changed for the survivors. Here each new hook gets the survivors' rows,
    renumbered, with the positions they were built at as its skin reference,
    so its first build (nvalchemi's per-system rebuild) makes only the
    admitted structures' lists (or :func:`append_neighbor_lists` gives it
    theirs, built apart); and it starts at the old list's capacity K
    (nvalchemi's density estimate is about seven times what argon needs).
    Every list stays a Verlet list of its structure (all pairs within the
    cutoff, at most ``skin / 2`` moved since it was built), so forces equal
    a fresh list's up to the order of the sum.

    Parameters
    ----------
    old_hooks, new_hooks : list
        The two engines' hooks; neighbour-list hooks are paired in order.
    old_batch : Batch
        The batch the old hooks built their lists for.
    kept : torch.Tensor
        Indices (long) of the structures of ``old_batch`` that continue, in
        the order they lead ``new_batch``.
    new_batch : Batch
        The refilled batch (not evaluated yet).
    """
    old = _list_hooks(old_hooks)
    new = _list_hooks(new_hooks)
    for previous, fresh in zip(old, new, strict=False):
        lists = neighbor_hook_lists(previous)
        if not lists or neighbor_hook_lists(fresh):
            continue
        seed = _renumbered(lists, old_batch, kept, new_batch, previous.skin)
        seed_neighbor_hook(fresh, *seed)


def _renumbered(
    lists: dict[str, torch.Tensor],
    old_batch: Batch,
    kept: torch.Tensor,
    new_batch: Batch,
    skin: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Return the survivors' rows of ``lists`` for ``new_batch``, empty rows after.

    Returns the matrix, counts, shifts and skin reference of
    :func:`~nvalchemi_ase._compat.seed_neighbor_hook`. A survivor's
    neighbours are atoms of its own structure, so renumbering is one offset
    per structure (entries past an atom's count are padding, which the hook
    rewrites at its next call). The admitted atoms' reference is put far
    from their positions, so their structures are built.
    """
    device = new_batch.positions.device
    new_atoms = int(new_batch.num_nodes)
    kept = kept.to(device)
    old_start = old_batch.batch_ptr[:-1].index_select(0, kept)
    sizes = old_batch.batch_ptr[1:].index_select(0, kept) - old_start
    new_start = torch.cumsum(sizes, 0) - sizes
    offsets = torch.repeat_interleave(old_start - new_start, sizes)  # old - new row
    carried = int(offsets.numel())
    rows = torch.arange(carried, device=device, dtype=offsets.dtype) + offsets
    capacity = int(lists["matrix"].shape[1])
    counts = torch.zeros(new_atoms, dtype=torch.int32, device=device)
    counts[:carried] = lists["num_neighbors"].index_select(0, rows)
    # columns past the longest row carried are padding in every row: filled
    # whole, only the ones before it renumbered (K is often 2-3 times that)
    used = min(int(counts.max()) if carried else 0, capacity)
    matrix = torch.empty((new_atoms, capacity), dtype=torch.int32, device=device)
    torch.sub(
        lists["matrix"][:, :used].index_select(0, rows),
        offsets.to(torch.int32).unsqueeze(1),
        out=matrix[:carried, :used],
    )
    columns = torch.arange(used, device=device, dtype=torch.int32)
    padding = columns.unsqueeze(0) >= counts[:carried].unsqueeze(1)
    matrix[:carried, :used].masked_fill_(padding, new_atoms)  # new_batch's fill
    matrix[:carried, used:] = new_atoms
    matrix[carried:] = new_atoms
    shifts = None
    if "shifts" in lists:
        shifts = torch.empty((new_atoms, capacity, 3), dtype=torch.int32, device=device)
        torch.index_select(lists["shifts"], 0, rows, out=shifts[:carried])
        shifts[carried:] = 0
    with torch.no_grad():
        reference = new_batch.positions.detach() + (10.0 * skin + 1.0)
        if "reference_positions" in lists:
            reference[:carried] = lists["reference_positions"].index_select(0, rows)
    return matrix, counts, shifts, reference


def lists_build_apart(hooks: list[Any]) -> bool:
    """Whether ``hooks``' lists can be built apart for a refill's admitted structures.

    (:func:`build_lists_apart`, then :func:`append_neighbor_lists`.) True
    when every neighbour-list hook among an engine's ``hooks`` holds one
    list it has built or been given (a composed model's hook, which writes
    several lists at once, does not qualify).
    """
    lists = [hook for hook in hooks if is_neighbor_hook(hook)]
    return all(
        not isinstance(hook, PipelineNeighborHook) and neighbor_hook_lists(hook)
        for hook in lists
    )


def build_lists_apart(hooks: list[Any], working: list[Any], batch: Batch) -> None:
    """Build fresh ``hooks``' lists for ``batch``, a refill's admitted structures alone.

    Parameters
    ----------
    hooks : list
        Unbuilt hooks made by :func:`neighbor_hooks` (one list each).
    working : list
        The working batch's hooks: each fresh list starts at the capacity K
        of its working list (nvalchemi's density estimate is about seven
        times what argon needs), and grows past it if an atom needs more.
    batch : Batch
        The admitted structures; their neighbour fields are written.
    """
    for hook, like in zip(_list_hooks(hooks), _list_hooks(working), strict=True):
        lists = neighbor_hook_lists(like)
        if lists:
            set_neighbor_capacity(hook, int(lists["matrix"].shape[1]))
    context = SimpleNamespace(batch=batch)
    for hook in hooks:
        hook(context, hook.stage)


def append_neighbor_lists(
    hooks: list[Any], built: list[Any], batch: Batch, first_atom: int
) -> None:
    """Give the working lists the admitted structures' rows, built apart.

    After a refill the working hooks hold the survivors' rows (carried by
    :func:`carry_neighbor_lists`) and empty rows for the admitted atoms,
    ``first_atom`` onwards; ``built`` holds the admitted structures' own lists
    (:func:`build_lists_apart`). Their rows are put in place, renumbered by
    ``first_atom`` (the admitted atoms' fill value becomes the batch's), K
    widened if theirs is larger, and each working list is taken as exact for
    ``batch`` (:meth:`adopt`): no list is built for the whole batch.

    Parameters
    ----------
    hooks : list
        The working batch's hooks (seeded by a carry).
    built : list
        Hooks that built the admitted structures' lists.
    batch : Batch
        The working batch: survivors' atoms, then the admitted ones.
    first_atom : int
        Row of the first admitted atom in ``batch``.
    """
    for hook, source in zip(_list_hooks(hooks), _list_hooks(built), strict=True):
        theirs = neighbor_hook_lists(source)
        width = int(theirs["matrix"].shape[1])
        lists = neighbor_hook_lists(hook)
        if width > lists["matrix"].shape[1] or "shifts" in theirs.keys() - lists:
            seed_neighbor_hook(
                hook,
                *_widened(lists, width, int(batch.num_nodes), "shifts" in theirs),
                lists["reference_positions"],
            )
            lists = neighbor_hook_lists(hook)
        with torch.no_grad():
            torch.add(
                theirs["matrix"], first_atom, out=lists["matrix"][first_atom:, :width]
            )
            lists["num_neighbors"][first_atom:] = theirs["num_neighbors"]
            if "shifts" in lists:
                lists["shifts"][first_atom:, :width] = theirs["shifts"]
            if "reference_positions" in theirs:  # else (no skin) rebuilt when used
                lists["reference_positions"][first_atom:] = theirs[
                    "reference_positions"
                ]
        hook.adopt(batch)


def adopt_neighbor_lists(hooks: list[Any], batch: Batch) -> None:
    """Take the lists ``hooks`` were seeded with as exact for ``batch`` (none built).

    For a batch whose structures all kept their lists (structures retired,
    none admitted): see :func:`carry_neighbor_lists`.
    """
    for hook in _list_hooks(hooks):
        hook.adopt(batch)


def _widened(
    lists: dict[str, torch.Tensor], width: int, fill: int, shifted: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return a list's matrix, counts and shifts, at least ``width`` columns wide.

    ``shifted``: give it (zero) shifts if it has none.
    """
    matrix = lists["matrix"]
    atoms, columns = matrix.shape
    width = max(width, columns)
    wider = torch.full((atoms, width), fill, dtype=matrix.dtype, device=matrix.device)
    wider[:, :columns] = matrix
    shifts = lists.get("shifts")
    if shifts is None and not shifted:
        return wider, lists["num_neighbors"], None
    wide_shifts = matrix.new_zeros((atoms, width, 3))
    if shifts is not None:
        wide_shifts[:, :columns] = shifts
    return wider, lists["num_neighbors"], wide_shifts


def neighbor_state(hook: Any) -> dict[str, torch.Tensor]:
    """Return the list ``hook`` holds, for a checkpoint (copies; empty if unbuilt).

    Parameters
    ----------
    hook : SkinNeighborListHook
        A hook made by :func:`neighbor_hooks`.

    Returns
    -------
    dict of torch.Tensor
        nvalchemi's list (``matrix`` [V, K], ``num_neighbors`` [V], ``shifts``
        [V, K, 3], ``reference_positions`` [V, 3] Å) and ``cell_at_build``
        [B, 3, 3] Å, the cells the skin test compares against.
    """
    if isinstance(hook, PipelineNeighborHook):
        return {
            f"{index}.{key}": value
            for index, inner in enumerate(hook.lists)
            for key, value in neighbor_state(inner).items()
        }
    state = neighbor_hook_state(hook)
    if state and hook._cell_at_build is not None:
        state["cell_at_build"] = hook._cell_at_build.clone()
    return state


def load_neighbor_state(
    hook: Any, state: dict[str, torch.Tensor], batch: Batch
) -> None:
    """Give ``hook`` (built once for ``batch``) the list of :func:`neighbor_state`.

    Parameters
    ----------
    hook : SkinNeighborListHook
        A hook that has built a list for ``batch`` (after the priming
        evaluation).
    state : dict of torch.Tensor
        What :func:`neighbor_state` returned in the run being continued.
    batch : Batch
        The batch; its neighbour fields are rewritten.
    """
    if not state:
        return
    if isinstance(hook, PipelineNeighborHook):
        for index, inner in enumerate(hook.lists):
            prefix = f"{index}."
            load_neighbor_state(
                inner,
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)},
                batch,
            )
        hook.rewrite(batch)
        return
    load_neighbor_hook_state(hook, state, batch)
    hook._written = _neighbor_data(batch)
    cell = state.get("cell_at_build")
    hook._cell_at_build = None if cell is None else cell.to(batch.device)


def _list_still_holds(hook: Any, batch: Batch) -> bool:
    """Whether the last list is still exact for ``batch`` (CPU only, see above).

    True when the batch still carries the very tensors the hook wrote, has the
    same atoms and systems, the same cells, and no atom moved more than
    ``skin / 2`` since the list was built.
    """
    return (
        hook._written is not None
        and _neighbor_data(batch) is hook._written
        and _within_skin(hook, batch)
    )


def _within_skin(hook: Any, batch: Batch) -> bool:
    """Whether ``hook``'s list still covers ``batch`` (CPU only): sizes, cells, moves.

    Same atoms and systems as at the build, same cells, and no atom moved more
    than ``skin / 2`` since.
    """
    if not devices.host_reads_are_free(batch.positions.device) or hook.skin <= 0.0:
        return False
    reference = neighbor_hook_reference(hook)
    if reference is None or hook.sizes != (batch.num_nodes, batch.num_graphs):
        return False
    cell = getattr(batch, "cell", None)  # compared, not copied: this runs every step
    if (cell is None) != (hook._cell_at_build is None) or (
        cell is not None and not torch.equal(cell, hook._cell_at_build)
    ):
        return False
    with torch.no_grad():
        moved = (batch.positions - reference).square().sum(dim=1).max()
    return bool(moved <= (0.5 * hook.skin) ** 2)


#: A neighbour matrix's fields on the batch (nvalchemi's atom-level keys).
_MATRIX_FIELDS = ("neighbor_matrix", "num_neighbors", "neighbor_matrix_shifts")


def neighbor_fields(batch: Batch) -> tuple[str, ...]:
    """Return the neighbour-matrix fields ``batch`` carries (none for a COO list).

    A hook writes them at every build or adoption (:meth:`adopt`), so a
    resized batch need not copy them: the hooks hold the lists themselves.
    A COO list (its own level of the batch) is left alone.
    """
    return tuple(key for key in _MATRIX_FIELDS if key in batch)


def _neighbor_data(batch: Batch) -> torch.Tensor | None:
    matrix = getattr(batch, "neighbor_matrix", None)
    return matrix if matrix is not None else getattr(batch, "neighbor_list", None)


def _cell_of(batch: Batch) -> torch.Tensor | None:
    cell = getattr(batch, "cell", None)
    return None if cell is None else cell.detach().clone()
