"""Composed models (nvalchemi's ``PipelineModelWrapper``): parts and neighbour lists.

``model_a + model_b`` (nvalchemi's ``BaseModelMixin.__add__``), :func:`compose`
and ``load_model("sevennet-0+d3")`` all give a ``PipelineModelWrapper`` that sums
its parts' energies, forces and stresses. Its parts may need different
neighbour lists (SevenNet-0: 5 Å COO; D3: 15 Å dense matrix); the pipeline
plans the lists ("sources") itself, sharing one list between parts whose
cutoffs are within ``max_cutoff_ratio`` (its ``neighbor_adaptation="auto"``;
``"always"``: one list at the largest cutoff, filtered for the others;
``"never"``: one per cutoff), and builds them with the hooks of its
``make_neighbor_hooks()``: with two or more sources, one hook that builds
every source and leaves them on the batch, where the pipeline's forward
picks each part's own. A batch without them is refused by the pipeline.

Everything here uses that machinery unchanged; only the hooks' inner
``NeighborListHook`` instances are swapped for this package's eager ones
(nvalchemi wraps their call in ``torch.compile``, seconds per new batch shape
on a CPU): :func:`neighbor_hook_for`. :func:`build_neighbors` is the one-shot
version for single evaluations (calculator, vibrations).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from nvalchemi_ase._compat import (
    eager_call,
    pipeline_hook_inner,
    pipeline_policy,
    pipeline_sources,
)
from nvalchemi_ase._quiet import import_quietly

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin, NeighborConfig

__all__ = [
    "adopt",
    "build_neighbors",
    "compose",
    "composed_parts",
    "eager_hook_class",
    "is_composed",
    "neighbor_configs",
    "neighbor_hook_for",
]

NeighborAdaptation = Literal["auto", "always", "never"]


def is_composed(model: object) -> bool:
    """Whether ``model`` is nvalchemi's ``PipelineModelWrapper`` (no import)."""
    return any(
        cls.__name__ == "PipelineModelWrapper"
        and cls.__module__.startswith("nvalchemi")
        for cls in type(model).__mro__
    )


def composed_parts(model: Any) -> list[Any]:
    """Return the models a composed model sums, in order (``[model]`` for any other).

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.

    Returns
    -------
    list of BaseModelMixin
        The pipeline's step models, nested pipelines flattened.
    """
    if not is_composed(model):
        return [model]
    return [
        part
        for group in model.groups
        for step in group.steps
        for part in composed_parts(step.model)
    ]


def compose(
    *models: BaseModelMixin,
    neighbor_adaptation: NeighborAdaptation = "auto",
    max_cutoff_ratio: float = 1.5,
) -> BaseModelMixin:
    """Sum models: ``compose(a, b)`` is ``a + b`` with the neighbour-list policy.

    Parameters
    ----------
    *models : BaseModelMixin
        Two or more models; each computes its own forces and stress, and the
        results are added (one direct ``PipelineGroup`` per model, as ``+``).
        A composed model among them contributes its parts.
    neighbor_adaptation : {"auto", "always", "never"}
        nvalchemi's policy for sharing neighbour lists between parts (see the
        module docstring).
    max_cutoff_ratio : float
        Largest cutoff ratio at which ``"auto"`` shares one list.

    Returns
    -------
    BaseModelMixin
        A ``PipelineModelWrapper``; energy [B, 1] eV, forces [V, 3] eV/Å,
        stress [B, 3, 3] eV/Å³: the sums of the parts'.
    """
    if len(models) < 2:
        raise ValueError(f"compose needs two or more models, got {len(models)}")
    pipeline = import_quietly("nvalchemi.models.pipeline")
    parts = [part for model in models for part in _direct_parts(model)]
    composed: BaseModelMixin = _composed_class()(
        groups=_groups(pipeline, parts),
        neighbor_adaptation=neighbor_adaptation,
        max_cutoff_ratio=max_cutoff_ratio,
    )
    return composed


def _groups(pipeline: Any, parts: list[Any]) -> list[Any]:
    """Return nvalchemi's pipeline groups for ``parts``, summed.

    One summing group per part; a part that reads an output of the part
    before it (Ewald and PME read AIMNet2's ``charges``) joins that part's group,
    and the group takes its forces and stress by autograd of the summed energy
    (nvalchemi's AIMNet2 + Ewald example), so they include the charges'
    dependence on the positions.
    """
    chains: list[list[Any]] = []
    for part in parts:
        wanted = set(part.model_config.required_inputs)
        if chains and wanted & set(chains[-1][-1].model_config.outputs):
            chains[-1].append(part)
        else:
            chains.append([part])
    return [
        pipeline.PipelineGroup(steps=chain, use_autograd=len(chain) > 1)
        for chain in chains
    ]


def adopt(model: Any) -> Any:
    """Return a composed model whose ``narrowed_outputs`` reaches its parts.

    nvalchemi 0.3's ``PipelineModelWrapper`` runs each part of a direct
    (summing) group with the part's own ``active_outputs``: narrowing the
    pipeline to ``{"energy", "forces", "stress"}`` gives no stress unless every
    part already computes it. The package asks for stress only through
    ``model.narrowed_outputs``, so a composed model is used as an instance of a
    subclass that narrows each direct part to the outputs it has as well. A
    user's pipeline is not changed: a new one over the same groups (the same
    part objects) and neighbour policy is returned. Any other model is
    returned as it is.

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.

    Returns
    -------
    BaseModelMixin
        ``model``, or the equivalent composed model.
    """
    cls = _composed_class()
    if not is_composed(model) or isinstance(model, cls):
        return model
    policy = pipeline_policy(model)
    adopted = cls(
        groups=list(model.groups), additive_keys=set(model.additive_keys), **policy
    )
    adopted.model_config.active_outputs = set(model.model_config.active_outputs)
    return adopted


@functools.cache
def _composed_class() -> type:
    """Return ``PipelineModelWrapper`` with ``narrowed_outputs`` reaching its parts."""
    base: Any = import_quietly("nvalchemi.models.pipeline").PipelineModelWrapper

    class ComposedModel(base):  # type: ignore[misc,valid-type]
        """nvalchemi's ``PipelineModelWrapper``; narrowing reaches direct parts."""

        @contextlib.contextmanager
        def narrowed_outputs(self, outputs: Iterable[str]) -> Iterator[None]:
            wanted = set(outputs)
            with contextlib.ExitStack() as stack:
                stack.enter_context(super().narrowed_outputs(wanted))
                for group in self.groups:
                    if group.use_autograd:
                        continue  # the pipeline narrows these parts itself
                    for step in group.steps:
                        own = wanted & set(step.model.model_config.outputs)
                        stack.enter_context(step.model.narrowed_outputs(own))
                yield

    return ComposedModel


def neighbor_configs(model: Any) -> list[NeighborConfig]:
    """Return the neighbour lists ``model`` needs, largest cutoff first.

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.

    Returns
    -------
    list of NeighborConfig
        A composed model's planned sources; otherwise its ``neighbor_config``
        (empty when it needs none).
    """
    if is_composed(model):
        return pipeline_sources(model)
    config = model.model_config.neighbor_config
    return [] if config is None else [config]


def neighbor_hook_for(model: Any, make_hook: Callable[[NeighborConfig], Any]) -> Any:
    """Return the multi-source neighbour hook of a composed model, or None.

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.
    make_hook : callable
        ``config -> NeighborListHook``: the hook to build each source with.

    Returns
    -------
    object or None
        For a composed model with two or more sources, the pipeline's own
        ``make_neighbor_hooks()[0]`` with its inner hooks replaced by
        ``make_hook(source_config)``; None otherwise (one list, or none, as
        ``model.model_config.neighbor_config`` says).
    """
    if len(neighbor_configs(model)) < 2:
        return None
    (hook,) = model.make_neighbor_hooks()
    inner = pipeline_hook_inner(hook)
    inner[:] = [make_hook(old.config) for old in inner]
    return hook


def build_neighbors(model: Any, batch: Batch) -> None:
    """Build every neighbour list ``model`` needs on ``batch`` (one evaluation).

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.
    batch : Batch
        Gets the model's neighbour fields (a composed model's sources too).
    """
    stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
    hook = neighbor_hook_for(
        model,
        lambda config: eager_hook_class()(config, stage=stages.BEFORE_COMPUTE),
    )
    if hook is not None:
        hook(SimpleNamespace(batch=batch), stages.BEFORE_COMPUTE)
        return
    config = model.model_config.neighbor_config
    if config is not None:
        import_quietly("nvalchemi.neighbors").compute_neighbors(batch, config=config)


@functools.cache
def eager_hook_class() -> type:
    """Return nvalchemi's ``NeighborListHook`` with its call run eagerly."""
    base: Any = import_quietly("nvalchemi.hooks").NeighborListHook
    eager = eager_call(base.__call__)

    class EagerNeighborListHook(base):  # type: ignore[misc,valid-type]
        """nvalchemi's ``NeighborListHook``, its call not compiled."""

        def __call__(self, ctx: Any, stage: Any) -> None:
            eager(self, ctx, stage)

    return EagerNeighborListHook


def _direct_parts(model: Any) -> list[Any]:
    """Return a plain-sum pipeline's parts; anything else as itself."""
    if not is_composed(model):
        return [model]
    simple = all(
        not group.use_autograd
        and group.derivative_fn is None
        and all(not step.wire for step in group.steps)
        for group in model.groups
    )
    if not simple:
        return [model]
    return [
        part
        for group in model.groups
        for step in group.steps
        for part in _direct_parts(step.model)
    ]
