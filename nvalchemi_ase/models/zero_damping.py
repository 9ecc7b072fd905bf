"""DFT-D3 with zero damping (Grimme 2010), what nvalchemiops' D3 kernel lacks.

``load_model("d3-zero", functional="pbe")``, ``"d3(pbe, damping='zero')"`` and
``"sevennet-0+d3-zero(pbe)"`` give this model. nvalchemi's ``DFTD3ModelWrapper``
(:mod:`~nvalchemi_ase.models.dispersion`) runs nvalchemiops' fused Warp kernel,
which has only rational (Becke-Johnson) damping. Here the two-body zero-damped
energy is an edge-vector model (:mod:`~nvalchemi_ase.models.edge_vectors`) on
nvalchemi's COO neighbour list, with forces and stress from one autograd pass,
built from tad-dftd3's and tad-mctc's published pieces (extra ``d3``), the same
data s-dftd3 uses:

* coordination numbers ``CN_i = Σ_j 1/(1 + exp(-16 (R_cov,ij / r_ij - 1)))``
  (D3's covalent radii, scaled by 4/3), over pairs within ``cutoff``;
* C6 interpolated by tad-dftd3's Gaussian weights of the reference systems
  (``tad_dftd3.model.weight_references``, up to 7 references per element, so
  H-Lr are all evaluated), ``C8 = 3 C6 Q_i Q_j`` (``Q = r4r2``);
* ``E = -½ Σ_ij [s6 C6 f6 / r⁶ + s8 C8 f8 / r⁸]`` over ordered pairs, with
  ``f_n = 1 / (1 + 6 (r / (rs_n R0_ij))^(-α_n))``, ``α6 = alp``, ``α8 = alp + 2``
  and the pairwise van der Waals radii ``R0_ij`` of D3 (tad-mctc's table);
* the functional's ``s6, s8, rs6, rs8, alp`` from s-dftd3's ``parameters.toml``
  (shipped in tad-dftd3), by name and with s-dftd3's aliases.

As for the BJ model: no three-body term (s-dftd3 with ``s9 = 0``); one cutoff
for pairs and coordination numbers; the pair energy tapered to zero over the
last ``smoothing_fraction`` of the cutoff with nvalchemiops' C² polynomial
``1 - (10t³ - 15t⁴ + 6t⁵)`` (0 = a hard cutoff, as s-dftd3). It runs in the
batch's dtype (float64 agrees with s-dftd3 to rounding).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from ase.units import Bohr, Hartree

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.models.edge_vectors import (
    EdgeGraph,
    EdgeVectorModule,
    edge_vector_outputs,
)

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin

__all__ = ["ZERO_DAMPING_ELEMENTS", "d3_zero_model"]

#: Atomic numbers with D3 reference data in tad-dftd3 (H-Lr).
ZERO_DAMPING_ELEMENTS = frozenset(range(1, 104))
#: 10^(decimals) of D3's published pairwise radii (Å).
VDW_DECIMALS = 1e4
#: The Bohr radius s-dftd3 (mctc-lib, CODATA 2018) converts its tables with, Å.
SDFTD3_BOHR = 0.529177210903
#: Steepness of D3's coordination-number counting function.
_KCN = 16.0


class _ZeroDampedD3(EdgeVectorModule):
    """Two-body D3 with zero damping on a batch (torch only; see the module)."""

    model_config: Any

    def __init__(self, params: dict[str, float], cutoff: float, smoothing: float):
        super().__init__()
        tables = _tables()
        for name, value in tables.items():
            self.register_buffer(name, value, persistent=False)
        self.params = dict(params)
        self.cutoff = float(cutoff)
        self.smoothing_fraction = float(smoothing)
        self.supported_elements = ZERO_DAMPING_ELEMENTS
        self.configure_edge_outputs(self.cutoff)

    def forward(self, data: Batch, **kwargs: Any) -> OrderedDict[str, Any]:
        """Energy, forces and (when active) stress of every structure in a batch.

        Parameters
        ----------
        data : nvalchemi.data.Batch
            B structures with ``positions`` [V, 3] Å, ``atomic_numbers`` [V],
            ``batch_idx`` [V], a COO neighbour list built with a cutoff of at
            least ``self.cutoff`` Å, and ``cell`` [B, 3, 3] Å for stress.
        **kwargs
            Ignored (nvalchemi interface).

        Returns
        -------
        OrderedDict
            Keys of ``model_config.active_outputs`` (sorted): ``energy`` [B, 1]
            eV, ``forces`` [V, 3] eV/Å, ``stress`` [B, 3, 3] eV/Å³ (tensile
            positive), in the dtype of ``positions``.
        """
        active = set(self.model_config.active_outputs) & set(self.model_config.outputs)
        numbers = data.atomic_numbers.long()
        _check_elements(numbers)
        dtype = data.positions.dtype
        want_stress = "stress" in active and _has_cell(data)  # stand-in cells too
        results = edge_vector_outputs(
            data,
            functools.partial(self._energy, numbers),
            cutoff=self.cutoff,
            dtype=dtype,
            want_forces="forces" in active,
            want_stress=want_stress,
            keep_graph=self.training or bool(data.positions.requires_grad),
            model_name="d3-zero",
        )
        if "stress" in active and not want_stress:  # no cell: ASE has no stress
            results["stress"] = data.positions.new_zeros((int(data.num_graphs), 3, 3))
        return OrderedDict(
            (key, results[key].to(dtype) if key in results else None)
            for key in sorted(active)
        )

    def _energy(self, numbers: torch.Tensor, graph: EdgeGraph) -> torch.Tensor:
        """Per-structure dispersion energy [B], eV."""
        dtype = graph.edge_vectors.dtype
        tables = {name: getattr(self, name).to(dtype) for name in _TABLE_NAMES}
        centre, neighbour = graph.edge_index
        z_i, z_j = numbers[centre], numbers[neighbour]
        distance = torch.linalg.vector_norm(graph.edge_vectors, dim=-1) / Bohr
        # coordination numbers (D3's exponential counting)
        radius = tables["rcov"][z_i] + tables["rcov"][z_j]
        count = 1.0 / (1.0 + torch.exp(-_KCN * (radius / distance - 1.0)))
        cn = distance.new_zeros(numbers.shape[0]).index_add(0, centre, count)
        # C6 from the Gaussian-weighted reference systems
        weights = reference_weights(numbers, cn, tables["cn_ref"])
        c6 = torch.einsum(
            "ea,eb,eab->e",
            weights[centre],
            weights[neighbour],
            tables["c6_ref"][z_i, z_j],
        )
        quadrupole = 3.0 * tables["r4r2"][z_i] * tables["r4r2"][z_j]
        r0 = tables["r0"][z_i, z_j]
        p = self.params
        f6 = 1.0 / (1.0 + 6.0 * (distance / (p["rs6"] * r0)) ** (-p["alp"]))
        f8 = 1.0 / (1.0 + 6.0 * (distance / (p["rs8"] * r0)) ** (-(p["alp"] + 2.0)))
        pair = (
            -0.5
            * c6
            * (p["s6"] * f6 / distance**6 + p["s8"] * quadrupole * f8 / distance**8)
        )
        pair = pair * self._switch(distance * Bohr)
        energy = pair.new_zeros(graph.num_graphs).index_add(0, graph.edge_graph, pair)
        return energy * Hartree

    def _switch(self, distance: torch.Tensor) -> torch.Tensor:
        """Taper [E] at distances (Å): nvalchemiops' C² polynomial, last fraction."""
        if self.smoothing_fraction <= 0:
            return torch.ones_like(distance)
        r_on = self.cutoff * (1.0 - self.smoothing_fraction)
        t = ((distance - r_on) / (self.cutoff - r_on)).clamp(0.0, 1.0)
        return 1.0 - t**3 * (10.0 - 15.0 * t + 6.0 * t * t)


_TABLE_NAMES = ("rcov", "r4r2", "r0", "cn_ref", "c6_ref")


def _tables() -> dict[str, torch.Tensor]:
    """D3's tables (float64, CPU, atomic units), indexed by atomic number."""
    cpu = {"dtype": torch.float64, "device": torch.device("cpu")}
    radii = import_quietly("tad_mctc.data.radii")
    data = import_quietly("tad_dftd3.data")
    reference = import_quietly("tad_dftd3.reference").Reference(**cpu)
    return {
        "rcov": radii.COV_D3(**cpu) * _bohr_ratio(),  # Bohr, scaled by 4/3
        "r4r2": data.R4R2(**cpu),
        "r0": _vdw_radii(radii),  # Bohr
        "cn_ref": reference.cn,  # [104, 7], -1 where no reference (and Z = 0)
        "c6_ref": reference.c6,  # [104, 104, 7, 7], Hartree Bohr⁶
    }


def reference_weights(
    numbers: torch.Tensor, cn: torch.Tensor, cn_ref: torch.Tensor
) -> torch.Tensor:
    """D3's Gaussian weights of each atom's reference systems [V, 7].

    ``w_a = exp(-4 (CN - CN_a)²) / Σ_b exp(-4 (CN - CN_b)²)`` over the element's
    references, as s-dftd3 and ``tad_dftd3.model.weight_references``. Written
    as a softmax: where every Gaussian underflows (CN far above the largest
    reference CN, e.g. Cs in CsCl with a 12 Å cutoff) the weight goes to the
    nearest reference, s-dftd3's choice, and the gradient stays finite (tad's
    division by the underflowed norm gives NaN forces there).
    """
    references = cn_ref[numbers]  # [V, 7], -1 where none
    exponent = -4.0 * (references - cn.unsqueeze(-1)) ** 2
    exponent = exponent.masked_fill(references < 0, float("-inf"))
    return torch.softmax(exponent, dim=-1)


def _vdw_radii(radii: Any) -> torch.Tensor:
    """D3's pairwise R0 [104, 104], Bohr, as s-dftd3 has them.

    tad-mctc stores them in float32 (relative error ~6e-8, which the steep
    damping, α = 14, turns into 2e-7 of the energy). The published table has
    four decimals in Å: rounded back to them and converted with s-dftd3's
    Bohr, they are s-dftd3's values.
    """
    aa2au = import_quietly("tad_mctc.units.length").AA2AU
    stored = radii.VDW_PAIRWISE(dtype=torch.float64, device=torch.device("cpu"))
    angstrom = torch.round(stored / aa2au * VDW_DECIMALS) / VDW_DECIMALS
    return angstrom / SDFTD3_BOHR


def _bohr_ratio() -> float:
    """tad-mctc's Bohr (CODATA 2014) over s-dftd3's (CODATA 2018).

    Both convert D3's tables from Å; the covalent radii differ by 4e-10
    relative, which shows as 1e-11 of the energy of a silicon crystal.
    """
    return float(1.0 / import_quietly("tad_mctc.units.length").AA2AU) / SDFTD3_BOHR


def _check_elements(numbers: torch.Tensor) -> None:
    bad = (numbers < 1) | (numbers > max(ZERO_DAMPING_ELEMENTS))
    if bool(bad.any()):
        found = sorted({int(z) for z in numbers[bad].tolist()})
        raise ValueError(f"d3-zero has reference data for H-Lr (1-103), not {found}")


def _has_cell(data: Any) -> bool:
    return isinstance(getattr(data, "cell", None), torch.Tensor)


@functools.cache
def _model_class() -> type:
    base = import_quietly("nvalchemi.models.base")
    return type(
        "D3ZeroDamping",
        (_ZeroDampedD3, base.BaseModelMixin),
        {
            "__module__": "nvalchemi_ase.models.zero_damping",
            "__qualname__": "D3ZeroDamping",
            "__doc__": "DFT-D3 two-body with zero damping (see the module).",
        },
    )


def d3_zero_model(
    params: dict[str, float], cutoff: float, smoothing_fraction: float
) -> BaseModelMixin:
    """Build the zero-damped D3 model from checked parameters (see ``d3``).

    Parameters
    ----------
    params : dict of str to float
        ``s6``, ``s8``, ``rs6``, ``rs8`` (dimensionless) and ``alp``.
    cutoff : float
        Pairs and coordination numbers, Å.
    smoothing_fraction : float
        Fraction of ``cutoff`` over which pair energies are tapered, [0, 1).

    Returns
    -------
    BaseModelMixin
        The model (eval mode).
    """
    model = _model_class()(params, cutoff, smoothing_fraction).eval()
    model.memory_estimate = _memory_estimate
    return model


def _memory_estimate(dtype: torch.dtype, device: Any) -> Any:
    """Per-edge tensors of one evaluation with its autograd graph (not measured).

    About 200 numbers per edge: the [7, 7] C6 references gathered per pair,
    the einsum's [7, 7] intermediate, their gradients, the weights of both atoms
    and the damping terms.
    """
    from nvalchemi_ase.models.memory import MemoryEstimate

    size = torch.finfo(dtype).bits // 8
    return MemoryEstimate(
        bytes_per_atom=200.0 * size,
        bytes_per_edge=200.0 * size,
        edges_per_atom_hint=1000.0,
        basis="d3-zero: its per-edge tensors counted (not measured)",
    )
