"""Models by name, and what the rest of the package needs to know about a model.

``load_model(name, **params)`` builds an nvalchemi model wrapper (a
``BaseModelMixin``) from a short name; every function in :mod:`nvalchemi_ase`
that takes a model also accepts any ``BaseModelMixin`` instance directly.

=================  ==========================================  =====================
name               model                                       parameters (units)
=================  ==========================================  =====================
``"lj"``           ``LennardJonesModelWrapper`` (analytic,     ``epsilon`` (eV),
                   one species, energy unshifted, optional     ``sigma`` (Å),
                   C2 switch)                                  ``cutoff`` (Å),
                                                               ``switch_width`` (Å)
``"demo"``         ``DemoModelWrapper(DemoModel())`` (random   ``seed``,
                   weights; a test model, not physics)         ``hidden_dim``
``"ewald"``        nvalchemi's ``EwaldModelWrapper``: Coulomb  ``cutoff`` (Å),
                   energy of ``initial_charges`` (e) in        ``accuracy``
                   periodic cells, k_e = Hartree·Bohr
``"pme"``          nvalchemi's ``PMEModelWrapper`` (particle-  ``cutoff`` (Å),
                   mesh Ewald), same inputs                    ``accuracy``,
                                                               ``mesh_spacing``
                                                               (Å), ``spline_
                                                               order``, ``alpha``
                                                               (1/Å)
``"aimnet2"``,     AIMNet2 (``aimnet`` package): molecules,    ``path`` (any v2
``"aimnet2-..."``  total charge ``info["charge"]``, predicted  file), ``member``
                   per-atom ``charges``; float32; extra        (0-3)
                   ``aimnet``; files from the weights folder
                   (:mod:`nvalchemi_ase.models.aimnet2`)
``"sevennet-0"``   SevenNet-0 (11 Jul 2024; alias              none
                   ``"7net-0"``): universal potential, 89
                   elements (MPtrj, PBE), 5 Å cutoff, float32
                   weights, batched; extra ``sevennet``
                   (weights ship in the ``sevenn`` wheel)
=================  ==========================================  =====================

Parameters are checked by name and type before the model is built (a string
such as ``epsilon="abc"`` is a ``TypeError`` naming the parameter and its unit).

**Supported elements.** :func:`supported_elements` tells which atomic numbers a
model can evaluate, and :func:`nvalchemi_ase.convert.check_images` (run by the
calculator and every dynamics object before any work) refuses structures with
other elements, naming the structure and the atom. A model declares its set
with an attribute, which any user model can set too::

    model.supported_elements = frozenset({1, 6, 7, 8})  # H, C, N, O

``None`` (or no attribute) means any element. SevenNet-0 declares the 89
elements of its checkpoint's type map; nvalchemi's demo model embeds the atomic
number itself (``DemoModel(num_atom_types=100)``: 1-99); Lennard-Jones ignores
atomic numbers (None).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase.convert import _supported_elements
from nvalchemi_ase.models import aimnet2, builtin, electrostatics, registry, sevennet

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "available_models",
    "is_model",
    "load_model",
    "model_native_dtype",
    "resolve_model",
    "supported_elements",
]

registry.register(
    registry.ModelInfo(
        name="lj",
        factory=builtin.lennard_jones,
        summary="Lennard-Jones (nvalchemi's Warp kernel; argon by default)",
        elements="any (one species)",
        cutoff="8.5 Å (parameter)",
        dtype="any",
        licence="Apache-2.0 (nvalchemi)",
    )
)
registry.register(
    registry.ModelInfo(
        name="demo",
        factory=builtin.demo,
        summary="nvalchemi's demo model, random weights (a test model, not physics)",
        elements="1-99",
        cutoff="none (no neighbour list, no PBC)",
        dtype="float32",
        licence="Apache-2.0 (nvalchemi)",
    )
)
registry.register(
    registry.ModelInfo(
        name="sevennet-0",
        factory=sevennet.sevennet_0,
        summary="SevenNet-0 (11 Jul 2024): universal potential, MPtrj (PBE/PBE+U)",
        elements="89 (H-Pu)",
        cutoff="5 Å",
        dtype="float32",
        licence="MIT (sevenn)",
        extra="sevennet",
        weights="ship in the sevenn wheel",
        aliases=("7net-0",),
    )
)

registry.register(
    registry.ModelInfo(
        name="ewald",
        factory=electrostatics.ewald,
        summary="Ewald sum of fixed charges (initial_charges, e; periodic cells)",
        elements="any",
        cutoff="10 Å real space (parameter); reciprocal from accuracy",
        dtype="any",
        licence="Apache-2.0 (nvalchemi, nvalchemiops)",
    )
)
registry.register(
    registry.ModelInfo(
        name="pme",
        factory=electrostatics.pme,
        summary="particle-mesh Ewald of fixed charges (initial_charges, e)",
        elements="any",
        cutoff="10 Å real space (parameter); 1 Å mesh (parameter)",
        dtype="any",
        licence="Apache-2.0 (nvalchemi, nvalchemiops)",
    )
)
for _variant in aimnet2.VARIANTS:
    registry.register(
        registry.ModelInfo(
            name=_variant.name,
            factory=aimnet2.aimnet2_factory(_variant),
            summary=_variant.summary
            + " (short-range part: add long-range Coulomb and D3)",
            elements=_variant.elements,
            cutoff="5 Å",
            dtype="float32",
            licence="MIT (aimnet)",
            extra="aimnet",
            weights=(
                f"{_variant.files[0]} (members 0-3: {_variant.files[0][:-4]}"
                f"[0-3].pt) from {_variant.source(0).rsplit('/', 1)[0]}/"
            ),
            aliases=_variant.aliases,
        )
    )


def available_models() -> list[str]:
    """Names accepted by :func:`load_model` (aliases included).

    Returns
    -------
    list of str
        Sorted model names; :func:`nvalchemi_ase.models.registry.entries` has
        what each one is.
    """
    return registry.names()


def load_model(name: str, **params: Any) -> BaseModelMixin:
    """Build an nvalchemi model from its short name.

    Parameters
    ----------
    name : str
        One of :func:`available_models` (case-insensitive), e.g. ``"lj"``.
    **params
        Model parameters, in ASE units (see the table in this module's docstring).

    Returns
    -------
    nvalchemi.models.base.BaseModelMixin
        A fresh model on the CPU; calculators and dynamics move it to their device.

    Raises
    ------
    ValueError
        For an unknown name (the known names are listed).
    ImportError
        When the model's optional package is missing (the extra to install is
        named).
    TypeError
        For a parameter the model does not take, or a value of the wrong type
        (the parameter and the expected type are named).
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    info = registry.lookup(name)
    if info is None:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(available_models())} "
            "(or pass any nvalchemi BaseModelMixin instance)"
        )
    factory = info.factory
    accepted = list(inspect.signature(factory).parameters)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise TypeError(
            f"{name}: unknown parameter(s) {unknown}; it takes "
            f"{accepted if accepted else 'no parameters'}"
        )
    return factory(**params)


def is_model(obj: object) -> bool:
    """Whether ``obj`` is an nvalchemi ``BaseModelMixin`` (without importing nvalchemi).

    Parameters
    ----------
    obj : object
        Anything.

    Returns
    -------
    bool
        True for nvalchemi model wrappers.
    """
    return any(
        cls.__name__ == "BaseModelMixin" and cls.__module__.startswith("nvalchemi.")
        for cls in type(obj).__mro__
    )


def resolve_model(model: BaseModelMixin | str, **params: Any) -> BaseModelMixin:
    """Return ``model`` itself, or :func:`load_model` of a name.

    Parameters
    ----------
    model : BaseModelMixin or str
        An nvalchemi model or a name for :func:`load_model`.
    **params
        Passed to :func:`load_model` when ``model`` is a name.

    Returns
    -------
    BaseModelMixin
        The model.

    Raises
    ------
    TypeError
        If ``model`` is neither, or parameters are given with a model instance.
    """
    if isinstance(model, str):
        return load_model(model, **params)
    if not is_model(model):
        raise TypeError(
            f"model must be an nvalchemi BaseModelMixin or a name from "
            f"{available_models()}, got {type(model).__name__}"
        )
    if params:
        raise TypeError(
            f"model parameters {sorted(params)} can only be given with a model name; "
            "configure a model instance before passing it"
        )
    return model


def model_native_dtype(model: BaseModelMixin) -> torch.dtype | None:
    """Return the floating dtype of a model's weights, or None for weightless models.

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.

    Returns
    -------
    torch.dtype or None
        dtype of the first floating parameter or buffer (e.g. float32 for
        SevenNet-0 and the demo model); None for analytic models such as LJ.
    """
    if not isinstance(model, torch.nn.Module):
        return None
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def supported_elements(model: BaseModelMixin) -> frozenset[int] | None:
    """Return the atomic numbers a model can evaluate, or None for any element.

    Parameters
    ----------
    model : BaseModelMixin
        Any nvalchemi model.

    Returns
    -------
    frozenset of int or None
        ``model.supported_elements`` when the model declares it (an iterable of
        atomic numbers; None means any); for nvalchemi's ``DemoModelWrapper``,
        whose embedding is indexed by the atomic number, 1 to
        ``num_atom_types - 1``; otherwise None (e.g. Lennard-Jones, which
        ignores atomic numbers).

    Raises
    ------
    TypeError
        If ``model.supported_elements`` is not a collection of integers.
    """
    return _supported_elements(model)
