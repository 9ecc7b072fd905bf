"""What an ASE-style dynamics object is given: structures, cell filters, a model.

``images`` may be one ``Atoms``, a list of them, or (for optimizers) ASE cell
filters wrapping them. The model comes from ``model=`` or from the
``NVAlchemiCalculator`` attached to the structures. Everything is checked here,
before any engine is built, and every error names the structure and the fix.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from ase import Atoms

from nvalchemi_ase.calculator import NVAlchemiCalculator
from nvalchemi_ase.convert import check_images
from nvalchemi_ase.devices import DtypeLike, resolve_device, resolve_dtype
from nvalchemi_ase.dynamics.constraints import (
    SUPPORTED_CONSTRAINTS,
    unsupported_constraint,
)
from nvalchemi_ase.models import model_native_dtype, resolve_model

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "CellFilterSpec",
    "ModelSetup",
    "check_constraints",
    "integer_argument",
    "real_argument",
    "real_arguments",
    "resolve_images",
    "resolve_model_setup",
]


@dataclass(frozen=True)
class CellFilterSpec:
    """The cell degrees of freedom ASE's filter asked for.

    Attributes
    ----------
    kind : str
        ``"FrechetCellFilter"`` or ``"UnitCellFilter"``.
    cell_factor : numpy.ndarray, shape (B,)
        ASE's per-structure scaling of the cell gradient (the number of atoms by
        default); the cell part of ``fmax`` is ``|σ V| / cell_factor`` per row.
    filters : list
        The filter objects (their options: ``scalar_pressure``,
        ``hydrostatic_strain``, ``constant_volume``, ``mask``).
    """

    kind: str
    cell_factor: Any
    filters: list[Any]


@dataclass
class ModelSetup:
    """The model and where it runs, shared by all structures of a run."""

    model: BaseModelMixin
    device: torch.device
    dtype: torch.dtype
    calculator: NVAlchemiCalculator


def resolve_images(
    images: Any, *, allow_cell_filters: bool
) -> tuple[list[Atoms], CellFilterSpec | None, bool]:
    """Split ``images`` into the structures and an optional cell-filter spec.

    Parameters
    ----------
    images : Atoms, Filter, or sequence of them
        One structure or several; cell filters (``FrechetCellFilter``,
        ``UnitCellFilter``) select variable-cell optimization for all of them.
    allow_cell_filters : bool
        False for molecular dynamics.

    Returns
    -------
    atoms : list of ase.Atoms
        The structures (the filters' own ``Atoms``), not copies.
    cell_filter : CellFilterSpec or None
        Set when the inputs are cell filters.
    single : bool
        Whether a single object (not a list) was passed.

    Raises
    ------
    TypeError, ValueError
        For an unsupported object, a mix of filtered and plain structures, or a
        filter option nvalchemi's variable-cell engines cannot honour.
    """
    single = not isinstance(images, Sequence)
    items = [images] if single else list(images)
    if not items:
        raise ValueError("images is empty; pass at least one ase.Atoms")
    filters = [_filter_kind(item) for item in items]
    if not any(filters):
        for index, item in enumerate(items):
            if not isinstance(item, Atoms):
                raise TypeError(
                    f"images[{index}] is a {type(item).__name__}; pass ase.Atoms "
                    "(or, for optimizers, FrechetCellFilter/UnitCellFilter)"
                )
        return items, None, single
    if not allow_cell_filters:
        raise TypeError(
            "cell filters select variable-cell optimization; molecular dynamics "
            "takes plain ase.Atoms (use IsotropicMTKNPT/MTKNPT for a moving cell)"
        )
    kinds = set(filters)
    if None in kinds or len(kinds) > 1:
        index = next(i for i, kind in enumerate(filters) if kind != filters[0])
        raise TypeError(
            f"images[{index}] is a {type(items[index]).__name__} but images[0] is a "
            f"{type(items[0]).__name__}; wrap every structure in the same cell filter"
        )
    for index, item in enumerate(items):
        _check_filter_options(index, item)
    kind = filters[0]
    assert kind is not None  # noqa: S101 - narrowed above
    factors = [
        float(
            getattr(item, "exp_cell_factor", None)
            or getattr(item, "cell_factor", None)
            or 1.0  # StrainFilter: its rows are the strain, its forces -V σ
        )
        for item in items
    ]
    atoms = [item.atoms for item in items]
    spec = CellFilterSpec(kind=kind, cell_factor=torch.tensor(factors), filters=items)
    return atoms, spec, single


def _filter_kind(item: Any) -> str | None:
    from ase.filters import FrechetCellFilter, StrainFilter, UnitCellFilter

    if isinstance(item, FrechetCellFilter):
        return "FrechetCellFilter"
    if type(item) is StrainFilter:
        return "StrainFilter"
    if isinstance(item, UnitCellFilter):
        if type(item) is not UnitCellFilter:
            raise TypeError(
                f"{type(item).__name__} is not supported; use FrechetCellFilter, "
                "UnitCellFilter or StrainFilter"
            )
        return "UnitCellFilter"
    if hasattr(item, "atoms") and not isinstance(item, Atoms):
        raise TypeError(
            f"{type(item).__name__} is not supported; use FrechetCellFilter, "
            "UnitCellFilter or StrainFilter for a variable cell, or plain Atoms"
        )
    return None


def _check_filter_options(index: int, item: Any) -> None:
    if getattr(item, "include_ideal_gas", False):
        raise ValueError(
            f"images[{index}]: StrainFilter(include_ideal_gas=True) is not supported "
            "(the model's stress has no kinetic part); use include_ideal_gas=False"
        )
    pressure = getattr(item, "scalar_pressure", 0.0)
    if isinstance(pressure, bool) or not np.isfinite(float(pressure)):
        raise ValueError(
            f"images[{index}]: scalar_pressure must be a finite number, eV/Å³ "
            f"(e.g. 1.0 * ase.units.GPa), got {pressure!r}"
        )
    if not item.atoms.pbc.all():
        raise ValueError(
            f"images[{index}]: a cell filter needs a structure periodic in all "
            f"three directions (pbc = {item.atoms.pbc.tolist()})"
        )


def check_constraints(atoms_list: list[Atoms]) -> None:
    """Raise unless every constraint is one the dynamics honour.

    ``FixAtoms`` (nvalchemi's frozen atoms) and ``FixCartesian``, ``FixCom``,
    ``FixSymmetry``, ``FixBondLengths`` and ``FixLinearTriatomic``
    (:mod:`nvalchemi_ase.dynamics.constraints`).

    Parameters
    ----------
    atoms_list : list of ase.Atoms
        The structures.

    Raises
    ------
    ValueError
        Naming the structure and the constraint class.
    """
    for index, atoms in enumerate(atoms_list):
        name = unsupported_constraint(atoms)
        if name is not None:
            supported = ", ".join(c.__name__ for c in SUPPORTED_CONSTRAINTS)
            raise ValueError(
                f"images[{index}] has constraint {name}; the batched dynamics "
                f"honour {supported}. Remove it, or run this structure with "
                "ASE's own dynamics"
            )


def resolve_model_setup(
    atoms_list: list[Atoms],
    model: BaseModelMixin | str | None,
    device: torch.device | str | None,
    dtype: DtypeLike,
    *,
    neighbor_skin: float = 0.0,
    check: bool = True,
) -> ModelSetup:
    """Find the model, device and dtype a run uses.

    With ``model=None`` the model is taken from the ``NVAlchemiCalculator``
    attached to the structures (one calculator shared by all, or calculators
    wrapping the same model object), and so are its device and dtype unless
    given. With ``model`` given, structures may carry no calculator or an
    ``NVAlchemiCalculator`` over that same model.

    Parameters
    ----------
    atoms_list : list of ase.Atoms
        The structures.
    model : BaseModelMixin or str or None
        Explicit model or :func:`~nvalchemi_ase.models.load_model` name.
    device : torch.device or str or None
        Explicit device.
    dtype : torch.dtype or str or None
        Explicit precision.
    neighbor_skin : float
        Verlet skin of the run's neighbour list, Å; the cell heights are checked
        against the model's cutoff plus this.
    check : bool
        Check the structures here (:func:`~nvalchemi_ase.convert.check_images`);
        False for a caller that converts them with the same checks at once
        (``atoms_to_batch(..., model=, skin=)``) before anything else is built.

    Returns
    -------
    ModelSetup
        The model (moved to device and dtype) and a calculator over it, used to
        give structures without one a calculator after the run.

    Raises
    ------
    ValueError
        If no model can be found, or the structures disagree about it.
    nvalchemi_ase.convert.StructureError
        For a structure the model cannot run (see
        :func:`~nvalchemi_ase.convert.check_images`), before anything is built.
    """
    calculators = [atoms.calc for atoms in atoms_list]
    for index, calc in enumerate(calculators):
        if calc is not None and not isinstance(calc, NVAlchemiCalculator):
            raise ValueError(
                f"images[{index}] has a {type(calc).__name__} calculator; batched "
                "dynamics run an nvalchemi model: attach NVAlchemiCalculator or pass "
                "model=... (and remove the other calculator)"
            )
    ours = [calc for calc in calculators if calc is not None]
    if model is None:
        if len(ours) < len(atoms_list):
            index = calculators.index(None)
            raise ValueError(
                f"images[{index}] has no calculator; pass model=... or attach an "
                "NVAlchemiCalculator to every structure"
            )
        resolved = ours[0].model
    else:
        resolved = resolve_model(model)
    for index, calc in enumerate(calculators):
        if calc is not None and calc.model is not resolved:
            raise ValueError(
                f"images[{index}]'s NVAlchemiCalculator wraps a different model "
                "object than the run's; share one model (or one calculator) between "
                "all structures"
            )
    if check:
        check_images(atoms_list, model=resolved, skin=neighbor_skin)
    reference = ours[0] if ours else None
    run_device = (
        resolve_device(device)
        if device is not None or reference is None
        else reference.device
    )
    default_dtype = (
        reference.dtype
        if reference is not None
        else (model_native_dtype(resolved) or torch.float64)
    )
    run_dtype = resolve_dtype(dtype, default=default_dtype)
    for index, calc in enumerate(ours):
        if (calc.device, calc.dtype) != (run_device, run_dtype):
            raise ValueError(
                f"the calculators disagree with the run on device/dtype (calculator "
                f"#{index}: {calc.device}, {calc.dtype}; run: {run_device}, "
                f"{run_dtype}); use one NVAlchemiCalculator for all structures"
            )
    calculator = reference or NVAlchemiCalculator(
        resolved, device=run_device, dtype=run_dtype
    )
    # the calculator's model: the user's object, or its copy on device/dtype
    return ModelSetup(calculator.model, run_device, run_dtype, calculator)


def real_argument(name: str, value: Any, unit: str) -> float:
    """Return a scalar argument as a float, refusing strings and booleans.

    ``float("1")`` works, so without this a timestep given as the string ``"1"``
    would silently run with 1 ASE time unit.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    value : Any
        A real number (Python, NumPy, or a 0-d array/tensor).
    unit : str
        Its unit, for the message (e.g. ``"ASE time units"``).

    Returns
    -------
    float
        The value (not range-checked).

    Raises
    ------
    TypeError
        If ``value`` is not a real number, naming the argument and its unit.
    """
    array = _numeric(name, value, unit, "a real number")
    if array.ndim != 0:
        raise TypeError(
            f"{name} must be one number ({unit}), got an array of shape {array.shape}"
        )
    return float(array)


def real_arguments(name: str, value: Any, unit: str) -> npt.NDArray[np.float64]:
    """Return a number or a sequence of numbers as float64, refusing strings.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    value : Any
        A real number or an array-like of them (e.g. one per structure).
    unit : str
        Its unit, for the message.

    Returns
    -------
    numpy.ndarray
        float64, the shape of ``value`` (not range-checked).

    Raises
    ------
    TypeError
        If ``value`` holds anything but real numbers (strings, booleans,
        objects), naming the argument and its unit.
    """
    return _numeric(name, value, unit, "a real number or one per structure").astype(
        np.float64
    )


def integer_argument(name: str, value: Any, what: str = "a count") -> int:
    """Return an integer argument as an int, refusing strings, booleans and floats.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    value : Any
        A Python or NumPy integer.
    what : str
        What the integer counts, for the message.

    Returns
    -------
    int
        The value (not range-checked).

    Raises
    ------
    TypeError
        If ``value`` is not an integer.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer ({what}), got {value!r} "
            f"({type(value).__name__})"
        )
    return int(value)


def _numeric(name: str, value: Any, unit: str, expected: str) -> npt.NDArray[Any]:
    problem = isinstance(value, str | bytes | bool | np.bool_) or value is None
    array = None
    if not problem:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):  # ragged sequences and the like
            problem = True
    if problem or array is None or array.dtype.kind not in "iuf":
        raise TypeError(
            f"{name} must be {expected} ({unit}), got {value!r} "
            f"({type(value).__name__})"
        )
    return array
