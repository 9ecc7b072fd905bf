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
``"sevennet-*"``   the other checkpoints of the ``sevenn``     ``modal`` (MF-0:
                   wheel: ``-0-22may2024``, ``-l3i5``,         ``"pbe"``,
                   ``-mf-0`` (and ``-mf-0-pbe``, ``-r2scan``)  ``"r2scan"``)
``"mace"``         any MACE model file, nvalchemi's            ``path``, ``dtype``,
                   ``MACEWrapper`` (:mod:`.mace`)              ``head``
``"mace-*"``       MACE foundation models from the weights     ``dtype``, ``head``
                   folder (``mace-mp-0-medium``, ...)
``"d3"``           DFT-D3(BJ) dispersion (nvalchemi's          ``functional``,
                   ``DFTD3ModelWrapper``), tables and 173      ``damping``,
                   functionals' parameters offline from        ``cutoff`` (Å),
                   tad-dftd3 (extra ``d3``;                    ``smoothing_fraction``
                   :mod:`~nvalchemi_ase.models.dispersion`)
``"d3-zero"``      DFT-D3 with zero damping (``"d3(pbe,        ``functional``,
                   damping='zero')"``), same tables            ``cutoff`` (Å),
                   (:mod:`~nvalchemi_ase.models.zero_damping`) ``smoothing_fraction``
=================  ==========================================  =====================

**Sums of models.** ``"a+b"`` sums the parts' energies, forces and stresses
(:func:`~nvalchemi_ase.models.composition.compose`, nvalchemi's
``PipelineModelWrapper``, each part with its own neighbour list, shared where
the cutoffs are close): ``"sevennet-0+d3"``, ``"sevennet-0+d3(pbe)"``,
``"lj+d3(b3lyp)"``, ``"lj(epsilon=0.01)+d3(r2scan, cutoff=20)"``. Inside a part's
parentheses, a bare first value is its first parameter (D3's ``functional``)
and ``key=value`` pairs the others. ``load_model("sevennet-0",
dispersion="d3")`` (or ``dispersion=True``, or ``"d3(b3lyp)"``) adds the
dispersion part to any model; a composed name takes no other keyword
parameters except ``neighbor_adaptation`` and ``max_cutoff_ratio`` (nvalchemi's
list-sharing policy). A MACE model file may stand for its part:
``"my.model+d3"`` is ``"mace(path='my.model')+d3"`` (also on the command line,
``--model my.model+d3``).

``nvalchemi-ase models`` lists every name with its facts (:mod:`.registry`).

Parameters are checked by name and type before the model is built (a string
such as ``epsilon="abc"`` is a ``TypeError`` naming the parameter and its unit).

**Supported elements.** :func:`supported_elements` tells which atomic numbers a
model can evaluate, and :func:`nvalchemi_ase.convert.check_images` (run by the
calculator and every dynamics object before any work) refuses structures with
other elements, naming the structure and the atom. A model declares its set
with an attribute, which any user model can set too::

    model.supported_elements = frozenset({1, 6, 7, 8})  # H, C, N, O

``None`` (or no attribute) means any element, ASE's ghost atom ``X`` (Z = 0)
included: the model indexes nothing by atomic number. SevenNet-0 declares the 89
elements of its checkpoint's type map, MACE its z table, AIMNet2 its species, D3
its tables; nvalchemi's demo model embeds the atomic number itself
(``DemoModel(num_atom_types=100)``: 1-99); Lennard-Jones, Ewald and PME ignore
atomic numbers (None: ghost atoms get the same numbers as any element, e.g.
ASE's ``bulk("X")`` with LJ). A composed model admits what all its parts admit.
"""

from __future__ import annotations

import ast
import inspect
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from nvalchemi_ase.convert import _supported_elements
from nvalchemi_ase.models import (
    aimnet2,
    builtin,
    composition,
    dispersion,
    electrostatics,
    mace,
    registry,
    sevennet,
)

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

for _family in (builtin, sevennet, dispersion, electrostatics, aimnet2, mace):
    _family.register_models()

#: Keyword parameters a composed name takes (the rest go in a part's parentheses).
_COMPOSE_PARAMETERS = ("neighbor_adaptation", "max_cutoff_ratio")
#: Model files a name may be instead of a registered name: suffix -> family
#: (``"my.model+d3"`` is ``"mace(path='my.model')+d3"``).
MODEL_FILE_SUFFIXES = {".model": "mace"}


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
        One of :func:`available_models` (case-insensitive), e.g. ``"lj"``, or
        a sum of them, e.g. ``"sevennet-0+d3(pbe)"`` (see "Sums of models" in
        this module's docstring).
    **params
        Model parameters, in ASE units (see the table in this module's
        docstring). ``dispersion=True`` (or ``"d3"``, ``"d3(b3lyp)"``: a model
        name) adds that model to the one named: ``load_model("sevennet-0",
        dispersion=True)`` is ``"sevennet-0+d3"``.

    Returns
    -------
    nvalchemi.models.base.BaseModelMixin
        A fresh model on the CPU; calculators and dynamics move it to their device.

    Raises
    ------
    ValueError
        For an unknown name or part of a composed name (named, and the known
        names listed).
    ImportError
        When the model's optional package is missing (the extra to install is
        named).
    TypeError
        For a parameter the model does not take, or a value of the wrong type
        (the parameter and the expected type are named).
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    extra = params.pop("dispersion", None)
    if extra is not None and extra is not False:
        if extra is True:
            extra = "d3"
        if not isinstance(extra, str):
            raise TypeError(
                f"dispersion must be True, False, None or a model name such as "
                f"'d3' or 'd3(b3lyp)', got {extra!r}"
            )
        return composition.compose(load_model(name, **params), load_model(extra))
    parts = _split_parts(name)
    if len(parts) == 1:
        head, own = _part_call(parts[0], name)
        return _load_one(head, {**own, **params})
    unknown = sorted(set(params) - set(_COMPOSE_PARAMETERS))
    if unknown:
        raise TypeError(
            f"{name}: a composed name takes only {list(_COMPOSE_PARAMETERS)} as "
            f"keyword parameters, got {unknown}; put a part's parameters in its "
            "parentheses, e.g. 'lj(epsilon=0.01)+d3(pbe, cutoff=20)'"
        )
    models = [_load_one(*_part_call(part, name), whole=name) for part in parts]
    return composition.compose(*models, **params)


def _split_parts(name: str) -> list[str]:
    """``"a+b(c, d=1)"`` → ``["a", "b(c, d=1)"]`` ('+' inside parentheses kept)."""
    parts, depth, start = [], 0, 0
    for position, char in enumerate(name):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "+" and depth == 0:
            parts.append(name[start:position].strip())
            start = position + 1
    parts.append(name[start:].strip())
    if any(not part for part in parts) or depth != 0:
        raise ValueError(
            f"model {name!r}: expected parts joined by '+', each a model name with "
            "optional parameters in parentheses, e.g. 'sevennet-0+d3(pbe)'"
        )
    return parts


def _part_call(part: str, whole: str) -> tuple[str, dict[str, Any]]:
    """``"d3(pbe, cutoff=20)"`` → ``("d3", {"functional": "pbe", "cutoff": 20})``.

    A model file (:data:`MODEL_FILE_SUFFIXES`) stands for its family with
    ``path=``: ``"my.model(dtype='float32')"`` → ``("mace", {"path": ...})``.
    """
    head, paren, rest = part.partition("(")
    head = head.strip()
    family = _file_family(head)
    if family is not None:
        _, given = _part_call(f"{family}({rest}" if paren else family, whole)
        return family, {**given, "path": head}
    if not paren:
        return head, {}
    if not rest.endswith(")"):
        raise ValueError(f"model {whole!r}: part {part!r} must end with ')'")
    info = registry.lookup(head)
    if info is None:
        _unknown(head, whole)
    names = list(inspect.signature(info.factory).parameters)
    params: dict[str, Any] = {}
    for index, item in enumerate(
        filter(None, (i.strip() for i in rest[:-1].split(",")))
    ):
        key, equals, value = item.partition("=")
        if not equals:
            if index > 0 or not names:
                raise ValueError(
                    f"model {whole!r}: in {part!r} only the first value may be "
                    f"given without a name (it is {names[0] if names else 'none'})"
                )
            key, value = names[0], item
        params[key.strip()] = _literal(value.strip())
    return head, params


def _file_family(head: str) -> str | None:
    """Return the model family of a file given as a model name, or None."""
    if registry.lookup(head) is not None:
        return None
    for suffix, family in MODEL_FILE_SUFFIXES.items():
        if head.lower().endswith(suffix):
            return family
    return None


def _literal(text: str) -> Any:
    """Read a number, bool or quoted string as Python does; other text as is."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(text.lower(), text)


def _unknown(part: str, whole: str) -> NoReturn:
    where = "" if part == whole else f" (a part of {whole!r})"
    raise ValueError(
        f"unknown model {part!r}{where}; known models: {', '.join(available_models())} "
        "(or pass any nvalchemi BaseModelMixin instance)"
    )


def _load_one(
    name: str, params: dict[str, Any], whole: str | None = None
) -> BaseModelMixin:
    """Build one registered model from its name and keyword parameters."""
    info = registry.lookup(name)
    if info is None:
        _unknown(name, whole or name)
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
    return composition.adopt(model)


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
    """Return the atomic numbers a model can evaluate, or None for any (0 included).

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
        ``num_atom_types - 1``; for a composed model, the elements all its
        parts declare; otherwise None (e.g. Lennard-Jones, which ignores atomic
        numbers and so admits ghost atoms, Z = 0).

    Raises
    ------
    TypeError
        If ``model.supported_elements`` is not a collection of integers.
    """
    return _supported_elements(model)
