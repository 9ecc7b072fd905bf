"""Γ-point vibrations of many structures at once: batched Hessians.

Two routes to the Hessian ``∂²E/∂R²`` (eV/Å²) of every structure:

* ``"hessian"``: nvalchemi's analytic, batched ``model.compute_hessian`` on
  one batch of all structures (double backward through the model). nvalchemi
  0.3 implements it for some wrappers (MACE, AIMNet2, ...); the models
  :func:`~nvalchemi_ase.models.load_model` builds (LJ, whose forces come from a
  Warp kernel, the demo model and SevenNet-0) raise ``DerivativeNotSupported``.
* ``"finite"``: central finite differences, ``±displacement`` on every
  Cartesian coordinate (6N structures per structure), with all displaced
  copies of all structures evaluated in batched ``calculate_batch`` calls, and
  the Hessian symmetrised as ASE's :class:`ase.vibrations.Vibrations` does.

``method="auto"`` takes the analytic route when the model supports it, else
finite differences. Frequencies and modes come from ASE's
:class:`ase.vibrations.VibrationsData`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from ase import Atoms, units

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import atoms_to_batch
from nvalchemi_ase.models.composition import build_neighbors
from nvalchemi_ase.properties._common import (
    Derived,
    Ledger,
    MaterialResult,
    evaluate,
    gather,
    materials,
    plan_chunks,
    resolve_calculator,
    validate,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["VibrationResult", "vibrations"]

#: How the Hessian is obtained.
HessianMethod = Literal["auto", "hessian", "finite"]

#: THz per eV (h ν = E).
_THZ_PER_EV = 1.0 / (units._hplanck / units._e * 1e12)


@dataclass
class VibrationResult(MaterialResult):
    """Γ-point vibrations of one structure.

    Attributes
    ----------
    method : str
        ``"hessian"`` (nvalchemi's analytic Hessian) or ``"finite"``
        (batched central finite differences).
    displacement : float or None
        Finite-difference step, Å (None for the analytic Hessian).
    hessian : numpy.ndarray, shape (3N, 3N)
        ``∂²E/∂R_i∂R_j``, eV/Å², rows and columns ordered atom by atom (x, y,
        z), symmetric.
    energies : numpy.ndarray, shape (3N,)
        Vibrational quanta ``ħω``, eV, ascending; imaginary modes negative.
    frequencies_cm : numpy.ndarray, shape (3N,)
        The same as wavenumbers, cm⁻¹ (imaginary negative).
    frequencies_thz : numpy.ndarray, shape (3N,)
        The same as frequencies, THz (imaginary negative).
    vibrations : ase.vibrations.VibrationsData
        ASE's object (modes, ``tabulate``, ``write_jmol``); not written to
        JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "displacement": "Å",
        "hessian": "eV/Å^2",
        "energies": "eV",
        "frequencies_cm": "1/cm",
        "frequencies_thz": "THz",
    }

    method: str | None = None
    displacement: float | None = None
    hessian: np.ndarray | None = None
    energies: np.ndarray | None = None
    frequencies_cm: np.ndarray | None = None
    frequencies_thz: np.ndarray | None = None
    vibrations: Any = field(default=None, repr=False, metadata={"json": False})


def vibrations(
    images: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    method: HessianMethod = "auto",
    displacement: float = 0.01,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[VibrationResult]:
    """Hessians and harmonic frequencies of every structure, batched.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Molecules (or cells, for Γ-point modes), ideally relaxed; never
        modified. Every atom vibrates (constraints are not applied).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name, nvalchemi model or calculator.
    method : {"auto", "hessian", "finite"}
        ``"hessian"``: nvalchemi's ``compute_hessian`` (raises if the model
        does not support it); ``"finite"``: batched finite differences;
        ``"auto"``: the first when supported, else the second.
    displacement : float
        Finite-difference step, Å.
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need (default: half of the memory
        free on the device).

    Returns
    -------
    list of VibrationResult
        One per structure, in input order; a failed one has ``error`` set.

    Raises
    ------
    ValueError
        For invalid arguments.
    nvalchemi.models.DerivativeNotSupported
        With ``method="hessian"`` for a model without analytic Hessians.
    """
    if method not in ("auto", "hessian", "finite"):
        raise ValueError(
            f"method must be 'auto', 'hessian' or 'finite', got {method!r}"
        )
    if not displacement > 0:
        raise ValueError(f"displacement must be positive (Å), got {displacement}")
    calc = resolve_calculator(model, device=device, dtype=dtype)
    structures = materials(images)
    ledger = Ledger(len(structures))
    validate(calc, structures, ledger)
    hessians = (
        _analytic(calc, structures, ledger, memory_budget, strict=method == "hessian")
        if method in ("auto", "hessian")
        else None
    )
    used = "hessian" if hessians is not None else "finite"
    if hessians is None:
        hessians = _finite(calc, structures, ledger, displacement, memory_budget)
    out = []
    for index, atoms in enumerate(structures):
        result = VibrationResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            method=used,
            displacement=float(displacement) if used == "finite" else None,
        )
        if ledger.alive(index):
            ledger.guard(
                index,
                partial(_fill, result, atoms, hessians[index]),
                "the normal-mode analysis",
            )
        result.error = ledger.errors.get(index)
        out.append(result)
    return out


def _analytic(
    calc: NVAlchemiCalculator,
    structures: list[Atoms],
    ledger: Ledger,
    memory_budget: float | None,
    *,
    strict: bool,
) -> list[np.ndarray | None] | None:
    """Hessians from ``model.compute_hessian``; None when the model lacks them."""
    models = import_quietly("nvalchemi.models")
    hessians: list[np.ndarray | None] = [None] * len(structures)
    alive = [k for k in range(len(structures)) if ledger.alive(k)]
    for part in plan_chunks(calc, [structures[k] for k in alive], memory_budget):
        chunk = [alive[k] for k in part]
        try:
            blocks = _hessian_batch(calc, [structures[k] for k in chunk])
        except models.DerivativeNotSupported:
            if strict:
                raise
            return None
        except Exception as error:  # isolated per structure
            for k in chunk:
                ledger.fail(
                    k, f"the batched Hessian failed ({type(error).__name__}: {error})"
                )
            continue
        for k, block in zip(chunk, blocks, strict=True):
            hessians[k] = block
    return hessians


def _hessian_batch(
    calc: NVAlchemiCalculator, structures: list[Atoms]
) -> list[np.ndarray]:
    """Dense Hessians (3N, 3N) of ``structures`` from one ``compute_hessian`` call."""
    batch = atoms_to_batch(
        structures, device=calc.device, dtype=calc.dtype, warn_dropped=False
    )
    build_neighbors(calc.model, batch)
    calc.model.compute_hessian(batch)
    packed = batch["hessian"].detach().to("cpu").double().numpy()
    blocks, offset = [], 0
    for atoms in structures:
        count = len(atoms)
        block = packed[offset : offset + count * count].reshape(count, count, 3, 3)
        offset += count * count
        blocks.append(block.transpose(0, 2, 1, 3).reshape(3 * count, 3 * count))
    return blocks


def _finite(
    calc: NVAlchemiCalculator,
    structures: list[Atoms],
    ledger: Ledger,
    displacement: float,
    memory_budget: float | None,
) -> list[np.ndarray | None]:
    """Central finite-difference Hessians, every displaced copy batched."""
    derived = []
    for index, atoms in enumerate(structures):
        for atom in range(len(atoms)):
            for axis in range(3):
                for sign in (-1.0, 1.0):
                    displaced = atoms.copy()
                    displaced.positions[atom, axis] += sign * displacement
                    step = sign * displacement
                    label = f"atom {atom} displaced by {step:+g} Å along {'xyz'[axis]}"
                    derived.append(Derived(index, displaced, label))
    results = evaluate(calc, derived, ["forces"], ledger, memory_budget=memory_budget)
    hessians: list[np.ndarray | None] = [None] * len(structures)
    position = 0
    for index, atoms in enumerate(structures):
        count = 6 * len(atoms)
        own = results[position : position + count]
        position += count
        if not ledger.alive(index):
            continue
        forces = gather(own, range(count), "forces")
        minus, plus = forces[0::2], forces[1::2]  # (3N, N, 3) each
        rows = (minus - plus).reshape(3 * len(atoms), -1) / (2.0 * displacement)
        hessians[index] = 0.5 * (rows + rows.T)
    return hessians


def _fill(result: VibrationResult, atoms: Atoms, hessian: np.ndarray | None) -> None:
    from ase.vibrations import VibrationsData

    if hessian is None or not np.isfinite(hessian).all():
        raise ValueError("the Hessian is not finite")
    hessian = 0.5 * (hessian + hessian.T)
    data = VibrationsData.from_2d(atoms, hessian)
    energies = data.get_energies()
    real = np.where(
        np.abs(energies.imag) > np.abs(energies.real),
        -np.abs(energies.imag),
        energies.real,
    )
    result.hessian = hessian
    result.energies = real
    result.frequencies_cm = real / units.invcm
    result.frequencies_thz = real * _THZ_PER_EV
    result.vibrations = data
