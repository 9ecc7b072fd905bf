"""Adsorption energies of many adsorbates on many sites of many slabs at once.

Every adsorbate is put on every site of every slab with
``ase.build.add_adsorbate``; those structures, every clean slab and every
adsorbate alone in vacuum are relaxed together in one in-flight stream
(:func:`nvalchemi_ase.runners.relax`, ions at fixed cell; each structure
leaves the working batch as it converges) or evaluated in batched calls:

    E_ads = E(slab + adsorbate) − E(slab) − E(adsorbate in vacuum)

(negative: binding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from ase import Atoms
from ase.build import add_adsorbate, molecule
from ase.data import chemical_symbols

from nvalchemi_ase.properties._common import (
    Derived,
    Ledger,
    MaterialResult,
    materials,
    resolve_calculator,
    validate,
)
from nvalchemi_ase.properties._energies import check_relaxation, energies, with_energy

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["AdsorptionResult", "adsorption_energies"]

#: A site: a name in the slab's ``info["adsorbate_info"]["sites"]`` (as
#: ``ase.build.fcc111`` and friends set them: ``"ontop"``, ``"bridge"``,
#: ``"fcc"``, ``"hcp"``, ``"hollow"``, ...) or an in-plane position (x, y), Å.
Site = str | tuple[float, float]


@dataclass
class AdsorptionResult(MaterialResult):
    """Adsorption energies on one slab.

    Attributes
    ----------
    adsorbates : list of str
        Chemical formula of each configuration's adsorbate, shape
        (n_configurations,).
    sites : list of str
        Each configuration's site (its name, or ``"x,y"`` in Å).
    adsorption_energies : numpy.ndarray, shape (n_configurations,)
        E(slab + adsorbate) − E(slab) − E(adsorbate), eV (negative: binding).
    energies : numpy.ndarray, shape (n_configurations,)
        E(slab + adsorbate), eV.
    slab_energy : float
        E(clean slab), eV.
    adsorbate_energies : numpy.ndarray, shape (n_configurations,)
        E(adsorbate in vacuum) of each configuration's adsorbate, eV.
    height : float
        Height of the adsorbate's anchor atom above the top layer, Å (before
        relaxation).
    relax : bool
        Whether the ions were relaxed (at fixed cell).
    relax_steps : numpy.ndarray of int, shape (n_configurations,)
        Optimizer steps of each configuration (0: already below ``fmax``; -1:
        not relaxed).
    structures : list of ase.Atoms
        The (relaxed) slab + adsorbate structures, energies attached, with
        ``info["site"]`` and ``info["adsorption_energy"]`` (eV); not written
        to JSON.
    slab : ase.Atoms or None
        The (relaxed) clean slab with its energy; not written to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "adsorption_energies": "eV",
        "energies": "eV",
        "slab_energy": "eV",
        "adsorbate_energies": "eV",
        "height": "Å",
    }

    adsorbates: list[str] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    adsorption_energies: np.ndarray | None = None
    energies: np.ndarray | None = None
    slab_energy: float | None = None
    adsorbate_energies: np.ndarray | None = None
    height: float = 2.0
    relax: bool = True
    relax_steps: np.ndarray | None = None
    structures: list[Atoms] = field(
        default_factory=list, repr=False, metadata={"json": False}
    )
    slab: Atoms | None = field(default=None, repr=False, metadata={"json": False})


def adsorption_energies(
    slabs: Atoms | Sequence[Atoms],
    adsorbates: Atoms | str | Sequence[Atoms | str],
    sites: Sequence[Site],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    height: float = 2.0,
    mol_index: int = 0,
    relax: bool = True,
    fmax: float = 0.01,
    steps: int = 1000,
    optimizer: str = "FIRE",
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[AdsorptionResult]:
    """Every adsorbate on every site of every slab, all relaxations in one stream.

    Parameters
    ----------
    slabs : ase.Atoms or sequence of ase.Atoms
        The slabs (surface normal along z, top face up, as ``ase.build``
        makes them; never modified). Their constraints (e.g. ``FixAtoms`` on
        the bottom layers) are kept in every relaxation.
    adsorbates : ase.Atoms, str or sequence of them
        Adsorbates: ``Atoms``, a chemical symbol (one atom) or a name of
        ``ase.build.molecule`` (ASE's g2 set, e.g. ``"CO"``, ``"H2O"``).
    sites : sequence of str or (x, y)
        Sites, each used for every adsorbate on every slab: a name in the
        slab's ``info["adsorbate_info"]["sites"]`` (set by
        ``ase.build.fcc111`` etc.) or an in-plane position, Å.
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name (``"lj"``, ``"sevennet-0"``), nvalchemi model or calculator.
    height : float
        Height of the anchor atom above the top layer, Å
        (``ase.build.add_adsorbate``).
    mol_index : int
        The adsorbate's anchor atom (``add_adsorbate``'s ``mol_index``).
    relax : bool
        Relax the ions of every structure at fixed cell (one in-flight run)
        or use single points.
    fmax : float
        Force threshold of the relaxations, eV/Å.
    steps : int
        Step limit of each structure's relaxation.
    optimizer : str
        Ion optimizer (``FIRE``, ``FIRE2``, ``LBFGS``, ``BFGS``).
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need.

    Returns
    -------
    list of AdsorptionResult
        One per slab, in input order, with ``len(adsorbates) * len(sites)``
        configurations (adsorbate-major: adsorbate 0 on every site first). A
        slab whose structures fail, or whose adsorbate reference failed, has
        ``error`` set; the others are computed.

    Raises
    ------
    ValueError
        For invalid arguments, unknown adsorbate names, or a named site a
        slab does not define (before any work).

    Notes
    -----
    The adsorbate in vacuum is the given molecule as it is, non-periodic
    (relaxed like the rest with ``relax``). Each slab's configurations use
    the same cell as the clean slab, so lateral interactions between
    periodic images of the adsorbate are included (use a large enough
    in-plane supercell).
    """
    check_relaxation(fmax, steps, optimizer)
    if not np.isfinite(height):
        raise ValueError(f"height must be finite (Å), got {height}")
    molecules = _adsorbates(adsorbates)
    site_list = list(sites)
    if not site_list:
        raise ValueError("sites is empty: give at least one site, e.g. 'ontop'")
    calc = resolve_calculator(model, device=device, dtype=dtype)
    structures = materials(slabs)
    _check_sites(structures, site_list)
    for j, adsorbate in enumerate(molecules):
        if not -len(adsorbate) <= mol_index < len(adsorbate):
            raise ValueError(
                f"mol_index {mol_index} is out of range for adsorbate {j} "
                f"({adsorbate.get_chemical_formula()}, {len(adsorbate)} atoms)"
            )
    count = len(structures)
    # materials 0..M-1 are the slabs, M..M+K-1 the adsorbate references
    ledger = Ledger(count + len(molecules))
    validate(calc, [*structures, *molecules], ledger)
    derived: list[Derived] = []
    for j, adsorbate in enumerate(molecules):
        if ledger.alive(count + j):
            label = f"adsorbate {adsorbate.get_chemical_formula()} in vacuum"
            derived.append(Derived(count + j, adsorbate.copy(), label))
    rows: dict[int, tuple[int, list[int], list[int]]] = {}
    for index, slab in enumerate(structures):
        if not ledger.alive(index):
            continue
        built = ledger.guard(
            index,
            partial(_configurations, slab, molecules, site_list, height, mol_index),
            "placing the adsorbates",
        )
        if built is None:
            continue
        clean = len(derived)
        derived.append(Derived(index, slab.copy(), "clean slab"))
        configuration_rows, which = [], []
        for j, site, atoms in built:
            configuration_rows.append(len(derived))
            which.append(j)
            label = f"{molecules[j].get_chemical_formula()} at {_site_name(site)}"
            derived.append(Derived(index, atoms, label))
        rows[index] = (clean, configuration_rows, which)
    values, relax_steps = energies(
        calc,
        derived,
        ledger,
        relax=relax,
        fmax=fmax,
        steps=steps,
        optimizer=optimizer,
        memory_budget=memory_budget,
    )
    reference = np.full(len(molecules), np.nan)
    for k, item in enumerate(derived):
        if item.material >= count:
            reference[item.material - count] = values[k]
    out = []
    for index, slab in enumerate(structures):
        result = AdsorptionResult(
            index=index,
            formula=slab.get_chemical_formula(),
            natoms=len(slab),
            height=float(height),
            relax=relax,
            adsorbates=[m.get_chemical_formula() for m in molecules for _ in site_list],
            sites=[_site_name(site) for _ in molecules for site in site_list],
        )
        for j in range(len(molecules)):
            if not ledger.alive(count + j) and ledger.alive(index):
                ledger.fail(
                    index,
                    f"the reference adsorbate {j} failed ({ledger.errors[count + j]})",
                )
        if ledger.alive(index):
            clean, configuration_rows, which = rows[index]
            _fill(
                result,
                derived,
                values,
                clean,
                configuration_rows,
                reference[which],
            )
            result.relax_steps = relax_steps[configuration_rows]
        result.error = ledger.errors.get(index)
        out.append(result)
    return out


def _adsorbates(adsorbates: Atoms | str | Sequence[Atoms | str]) -> list[Atoms]:
    items = [adsorbates] if isinstance(adsorbates, Atoms | str) else list(adsorbates)
    if not items:
        raise ValueError("adsorbates is empty: give at least one, e.g. 'CO'")
    molecules = []
    for j, item in enumerate(items):
        if isinstance(item, Atoms):
            copy = item.copy()
            copy.calc = None
        elif item in chemical_symbols[1:]:
            copy = Atoms(item)
        else:
            try:
                copy = molecule(item)
            except KeyError:
                raise ValueError(
                    f"adsorbates[{j}] = {item!r} is neither a chemical symbol nor "
                    "a name of ase.build.molecule (ASE's g2 set); pass an Atoms"
                ) from None
        if len(copy) == 0:
            raise ValueError(f"adsorbates[{j}] has no atoms")
        copy.pbc = False
        copy.cell = np.zeros((3, 3))
        molecules.append(copy)
    return molecules


def _check_sites(slabs: list[Atoms], sites: list[Site]) -> None:
    for k, site in enumerate(sites):
        if isinstance(site, str):
            for index, slab in enumerate(slabs):
                known = slab.info.get("adsorbate_info", {}).get("sites", {})
                if site not in known:
                    names = ", ".join(sorted(known)) or "none"
                    raise ValueError(
                        f"site {site!r} is not defined for slab {index} "
                        f"({slab.get_chemical_formula()}; its named sites: {names}); "
                        "build it with ase.build.fcc111 etc. or give (x, y) in Å"
                    )
        else:
            position = np.asarray(site, dtype=float)
            if position.shape != (2,) or not np.isfinite(position).all():
                raise ValueError(
                    f"sites[{k}] must be a site name or a finite (x, y) in Å, "
                    f"got {site!r}"
                )


def _site_name(site: Site) -> str:
    if isinstance(site, str):
        return site
    return f"{float(site[0]):g},{float(site[1]):g}"


def _configurations(
    slab: Atoms,
    molecules: list[Atoms],
    sites: list[Site],
    height: float,
    mol_index: int,
) -> list[tuple[int, Site, Atoms]]:
    """Every adsorbate on every site of one slab (adsorbate-major)."""
    built = []
    for j, adsorbate in enumerate(molecules):
        for site in sites:
            atoms = slab.copy()
            position = site if isinstance(site, str) else tuple(map(float, site))
            add_adsorbate(
                atoms, adsorbate, height, position=position, mol_index=mol_index
            )
            built.append((j, site, atoms))
    return built


def _fill(
    result: AdsorptionResult,
    derived: list[Derived],
    values: np.ndarray,
    clean: int,
    configuration_rows: list[int],
    reference: np.ndarray,
) -> None:
    slab_energy = float(values[clean])
    total = values[configuration_rows]
    adsorption = total - slab_energy - reference
    result.slab_energy = slab_energy
    result.energies = total
    result.adsorbate_energies = reference
    result.adsorption_energies = adsorption
    result.slab = with_energy(derived[clean].atoms, slab_energy)
    result.structures = [
        with_energy(derived[k].atoms, energy, site=site, adsorption_energy=float(value))
        for k, energy, site, value in zip(
            configuration_rows, total, result.sites, adsorption, strict=True
        )
    ]
