"""DFT-D3 dispersion by functional name, offline: ``load_model("d3", functional=...)``.

The model is nvalchemi's ``DFTD3ModelWrapper`` (nvalchemiops' Warp D3 kernel,
two-body, Becke-Johnson / rational damping). nvalchemi downloads Grimme's
reference tables at first use; here they never are downloaded. They come from
the ``tad-dftd3`` wheel (Apache-2.0, extra ``d3``), which vendors s-dftd3's data:

* reference C6 coefficients (``reference-c6.pt``, [104, 104, 7, 7], Hartree
  Bohr⁶) and reference coordination numbers ([104, 7]), cut to nvalchemi's
  layout (Z = 0-94, 5 references per element: ``c6ab``, ``cn_ref``
  [95, 95, 5, 5]; ``cn_ref[i, j, p, q]`` is the CN of reference ``p`` of
  element ``i``, -1 where that reference does not exist);
* covalent radii (D3's, scaled by 4/3, Bohr) and sqrt(0.5 <r⁴>/<r²> sqrt(Z));
* the damping parameters of 173 functionals (``param/parameters.toml``, the file
  s-dftd3 reads), with s-dftd3's name aliases (``"b3lyp5"`` → ``"b3lyp"``).

For Z ≤ 86 these tables are identical to the original Fortran DFT-D3 tables;
for Fr and Ra they are s-dftd3's newer ones. Six actinides (Ac, Pa, U, Np, Pu)
have 6-7 references in s-dftd3, more than nvalchemi's 5-wide kernel holds, so
D3 supports H-Ra and Th (:data:`D3_ELEMENTS`) and refuses the others by name.

The parameter file nvalchemi loads is written once per tad-dftd3 version into
:func:`~nvalchemi_ase.models.weights.weights_dir` (``d3/``), or a temporary
folder when that one is not writable, and passed with ``auto_download=False``.

Differences from s-dftd3 (``dftd3.ase.DFTD3``), the reference the tests compare
against:

* no three-body (Axilrod-Teller-Muto) term: nvalchemiops has none, so this is
  s-dftd3 with ``s9 = 0``;
* one real-space cutoff for pairs and coordination numbers, ``cutoff`` (Å,
  default 15 as nvalchemi's), with the pair energy tapered to zero over the
  last ``smoothing_fraction`` of it (nvalchemi's C5 smoothing; 0 = a hard
  cutoff). s-dftd3 cuts pairs at 60 Bohr and CNs at 40 Bohr, unsmoothed; with
  ``smoothing_fraction=0`` and both of its cutoffs set to ``cutoff`` the two
  agree to the kernel's float32 precision;
* the kernel returns float32 energies and forces (nvalchemiops), so the
  relative precision is ~1e-7 whatever the batch dtype.

Only rational damping exists in the kernel: ``damping="bj"`` (D3(BJ)) and
``"bjm"`` (modified BJ, same functional form). Zero damping, ``damping="zero"``
(or the name ``"d3-zero"``), is the edge-vector model of
:mod:`~nvalchemi_ase.models.zero_damping` on the same tables. Modified zero
damping (``"zerom"``), optimised power and CSO raise a ``ValueError`` saying so.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import importlib.util
import os
import tempfile
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.models import registry
from nvalchemi_ase.models.builtin import _real
from nvalchemi_ase.models.weights import weights_dir

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "D3_DAMPINGS",
    "D3_ELEMENTS",
    "d3",
    "d3_functionals",
    "d3_parameter_file",
    "d3_parameters",
    "d3_zero",
    "register_models",
]

#: Damping functions: rational / Becke-Johnson (nvalchemiops' kernel) and zero
#: damping (:mod:`~nvalchemi_ase.models.zero_damping`).
D3_DAMPINGS = ("bj", "bjm", "zero")
#: Other D3 dampings s-dftd3 knows, refused with an explanation.
_OTHER_DAMPINGS = ("zerom", "op", "cso")
#: Parameters of each damping function, as s-dftd3 names them.
_PARAMETER_NAMES = {
    "bj": ("s6", "s8", "a1", "a2"),
    "bjm": ("s6", "s8", "a1", "a2"),
    "zero": ("s6", "s8", "rs6", "rs8", "alp"),
}
#: Largest atomic number in nvalchemi's D3 table layout, and references per element.
_MAX_Z = 94
_REFERENCES = 5
#: nvalchemi's D3 tables the kernel reads as float32 whatever the model's dtype.
_KERNEL_TABLES = ("c6ab", "cn_ref")
#: Version of the file layout written by :func:`d3_parameter_file`.
_FILE_FORMAT = 1


def _reference_counts() -> list[int]:
    """Count the reference systems per element in s-dftd3's data (index = Z, 0-103)."""
    reference = import_quietly("tad_dftd3.reference")
    cn = reference._load_cn(dtype=torch.float64, device=torch.device("cpu"))
    return [int(n) for n in (cn >= 0).sum(dim=1)]


#: Atomic numbers D3 evaluates: 1-94 with at most five reference systems
#: (H-Ra, Th). Fixed by s-dftd3's data; ``tests/test_dispersion.py`` checks it
#: against the installed tad-dftd3.
D3_ELEMENTS = frozenset(range(1, 89)) | frozenset({90})


def d3_parameters(functional: str = "pbe", damping: str = "bj") -> dict[str, float]:
    """Damping parameters of a functional, from s-dftd3's table (offline).

    Parameters
    ----------
    functional : str
        Functional name, case- and hyphen-insensitive, with s-dftd3's aliases
        (``"PBE"``, ``"b3-lyp"``, ``"b3lyp5"``, ``"r2scan"``, ``"pbe0"``).
    damping : str
        ``"bj"`` (Becke-Johnson rational damping), ``"bjm"`` (modified BJ) or
        ``"zero"`` (zero damping).

    Returns
    -------
    dict of str to float
        Rational damping: ``s6``, ``s8``, ``a1`` (dimensionless) and ``a2``
        (Bohr). Zero damping: ``s6``, ``s8``, ``rs6``, ``rs8`` and ``alp``
        (dimensionless).

    Raises
    ------
    ValueError
        For an unknown functional (close names are suggested), a damping the
        kernel does not implement, or a functional without that damping.
    ImportError
        When tad-dftd3 (extra ``d3``) is not installed.
    """
    damping = _damping(damping)
    table, aliases = _functional_tables()
    key = _normalized(functional)
    key = aliases.get(key, key)
    entry = table["parameter"].get(key)
    if entry is None:
        close = difflib.get_close_matches(key, list(table["parameter"]), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"d3: unknown functional {functional!r}{hint} "
            f"({len(table['parameter'])} known: nvalchemi_ase.models.dispersion."
            "d3_functionals())"
        )
    variants = entry.get("d3", {})
    if damping not in variants:
        raise ValueError(
            f"d3: functional {functional!r} has no D3({damping}) parameters; it has "
            f"{', '.join(sorted(variants)) or 'none'} (implemented: "
            f"{', '.join(D3_DAMPINGS)})"
        )
    merged = {**table["default"]["parameter"]["d3"][damping], **variants[damping]}
    # s-dftd3 takes s8 = 0 where a functional's entry has none (cf22d, zero)
    merged.setdefault("s8", 0.0)
    return {name: float(merged[name]) for name in _PARAMETER_NAMES[damping]}


def d3_functionals(damping: str = "bj") -> list[str]:
    """Functionals with parameters for ``damping``, sorted (canonical names).

    Parameters
    ----------
    damping : str
        ``"bj"``, ``"bjm"`` or ``"zero"``.

    Returns
    -------
    list of str
        Names :func:`d3_parameters` accepts (aliases not listed).
    """
    damping = _damping(damping)
    table, _ = _functional_tables()
    return sorted(
        name
        for name, entry in table["parameter"].items()
        if damping in entry.get("d3", {})
    )


def d3(
    functional: str = "pbe",
    damping: str = "bj",
    cutoff: float = 15.0,
    smoothing_fraction: float = 0.2,
) -> BaseModelMixin:
    """DFT-D3 dispersion (two-body) for a named functional.

    Parameters
    ----------
    functional : str
        The DFT functional the correction is for (see :func:`d3_parameters`).
    damping : str
        ``"bj"`` (default) or ``"bjm"`` (rational damping, nvalchemi's
        ``DFTD3ModelWrapper``), or ``"zero"`` (zero damping,
        :mod:`~nvalchemi_ase.models.zero_damping`; also ``"d3-zero"``).
    cutoff : float
        Real-space cutoff for pairs and coordination numbers, Å.
    smoothing_fraction : float
        Fraction of ``cutoff`` over which the pair energy is tapered to zero
        (nvalchemi's C5 smoothing), in [0, 1); 0 is a hard cutoff.

    Returns
    -------
    BaseModelMixin
        nvalchemi's ``DFTD3ModelWrapper`` (energy eV [B, 1], forces eV/Å, stress
        eV/Å³ for periodic cells) with float64 tables, ``supported_elements``
        :data:`D3_ELEMENTS`, and a ``memory_estimate``; for zero damping the
        model of :mod:`~nvalchemi_ase.models.zero_damping` (H-Lr).
    """
    if not isinstance(functional, str):
        raise TypeError(f"d3: functional must be a str, got {functional!r}")
    cutoff = _real("d3", "cutoff", cutoff, "Å")
    smoothing_fraction = _real("d3", "smoothing_fraction", smoothing_fraction, "")
    if not 0 < cutoff < float("inf"):
        raise ValueError(f"d3: cutoff must be positive and finite, got {cutoff} Å")
    if not 0 <= smoothing_fraction < 1:
        raise ValueError(
            f"d3: smoothing_fraction must be in [0, 1), got {smoothing_fraction}"
        )
    params = d3_parameters(functional, damping)
    if _damping(damping) == "zero":
        from nvalchemi_ase.models.zero_damping import d3_zero_model

        return d3_zero_model(params, cutoff, smoothing_fraction)
    model = _d3_class()(
        a1=params["a1"],
        a2=params["a2"],
        s8=params["s8"],
        s6=params["s6"],
        cutoff=cutoff,
        smoothing_fraction=smoothing_fraction,
        auto_download=False,
        param_file=d3_parameter_file(),
    )
    model.to(torch.float64)  # float64 model: the calculator's default dtype
    model.keep_kernel_tables_float32()
    model.supported_elements = D3_ELEMENTS
    from nvalchemi_ase.models.memory import dense_matrix_estimate

    model.memory_estimate = dense_matrix_estimate(cutoff, "D3")
    return model


def d3_parameter_file() -> Path:
    """Path of nvalchemi's D3 parameter file built from tad-dftd3's tables.

    Written on first use into ``weights_dir() / "d3"`` (atomically), or a
    temporary folder when that is not writable; later calls reuse it.

    Returns
    -------
    pathlib.Path
        A ``torch.save`` file with ``rcov`` [95] (Bohr), ``r4r2`` [95],
        ``c6ab`` [95, 95, 5, 5] (Hartree Bohr⁶) and ``cn_ref`` [95, 95, 5, 5]
        (float64), the keys ``DFTD3ModelWrapper(param_file=...)`` reads.
    """
    name = f"dftd3-tad-dftd3-{_tad_version()}-v{_FILE_FORMAT}.pt"
    for folder in (weights_dir() / "d3", Path(tempfile.gettempdir()) / "nvalchemi_ase"):
        path = folder / name
        if path.is_file():
            return path
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, d3_tables())
        except OSError:
            continue
        return path
    raise OSError(
        f"d3: cannot write the D3 parameter file {name} into {weights_dir() / 'd3'} "
        "or the temporary folder; set NVALCHEMI_ASE_WEIGHTS to a writable folder"
    )


def d3_tables() -> dict[str, torch.Tensor]:
    """Return nvalchemi's four D3 tables from tad-dftd3's data (float64, CPU).

    Returns
    -------
    dict of str to torch.Tensor
        ``rcov``, ``r4r2`` [95]; ``c6ab``, ``cn_ref`` [95, 95, 5, 5] (see the
        module docstring for units and layout).
    """
    cpu = {"dtype": torch.float64, "device": torch.device("cpu")}
    reference = import_quietly("tad_dftd3.reference")
    data = import_quietly("tad_dftd3.data")
    radii = import_quietly("tad_mctc.data.radii")
    size, refs = _MAX_Z + 1, _REFERENCES
    c6 = reference._load_c6(**cpu)[:size, :size, :refs, :refs].contiguous()
    cn = reference._load_cn(**cpu)[:size, :refs]
    cn_ref = cn[:, None, :, None].expand(size, size, refs, refs).contiguous()
    return {
        "rcov": radii.COV_D3(**cpu)[:size].contiguous(),
        "r4r2": data.R4R2(**cpu)[:size].contiguous(),
        "c6ab": c6,
        "cn_ref": cn_ref,
    }


# -- internals ---------------------------------------------------------------------


@functools.cache
def _d3_class() -> type:
    """Return nvalchemi's ``DFTD3ModelWrapper``, zero stress for unperiodic batches.

    The kernel refuses a virial without periodic shifts, i.e. for a batch with
    no periodic structure; ASE has no stress for those, and the calculator
    drops stress for cells of rank below 3 anyway.
    """
    base: Any = import_quietly("nvalchemi.models.dftd3").DFTD3ModelWrapper

    class DFTD3(base):  # type: ignore[misc,valid-type]
        """nvalchemi's D3(BJ) wrapper; stress is zero for an unperiodic batch.

        The two [95, 95, 5, 5] reference tables stay float32 whatever the
        model's dtype (:meth:`keep_kernel_tables_float32`): nvalchemiops' kernel
        reads them as float32 and would otherwise convert both at every call
        (about a third of a 506-atom evaluation's CPU time on a CPU, section 16
        of docs/performance.md); the values are the same either way (nvalchemi
        stores float32 tables).
        """

        def keep_kernel_tables_float32(self) -> None:
            """Hold ``c6ab`` and ``cn_ref`` as float32 attributes, not buffers.

            Out of the buffers they keep float32 through ``.to(dtype)``, and
            the calculator's dtype check (every floating buffer in the
            calculator's dtype) still sees the model in its own dtype.
            """
            for name in _KERNEL_TABLES:
                table = getattr(self, name).to(torch.float32)
                delattr(self, name)  # the buffer
                setattr(self, name, table)

        def _apply(self, fn: Any, recurse: bool = True) -> Any:
            """Move the kernel tables with the module (device), kept float32."""
            module = super()._apply(fn, recurse)
            for name in _KERNEL_TABLES:
                table = self.__dict__.get(name)
                if isinstance(table, torch.Tensor):
                    setattr(self, name, fn(table).to(torch.float32))
            return module

        def forward(self, data: Any, **kwargs: Any) -> Any:
            active = self.model_config.active_outputs
            if (
                "stress" not in active
                or getattr(data, "neighbor_matrix_shifts", None) is not None
            ):
                return super().forward(data, **kwargs)
            self.model_config.active_outputs = set(active) - {"stress"}
            try:
                outputs = super().forward(data, **kwargs)
            finally:
                self.model_config.active_outputs = active
            positions = data.positions
            outputs["stress"] = positions.new_zeros((data.num_graphs, 3, 3))
            return outputs

    return DFTD3


def _damping(damping: str) -> str:
    if not isinstance(damping, str):
        raise TypeError(f"d3: damping must be a str, got {damping!r}")
    key = damping.lower().removeprefix("d3").strip("()-_ ")
    if key in D3_DAMPINGS:
        return key
    if key in _OTHER_DAMPINGS:
        raise ValueError(
            f"d3: damping {damping!r} is not available: implemented are rational "
            "(Becke-Johnson) damping, damping='bj' or 'bjm' (nvalchemiops' "
            "kernel), and zero damping, damping='zero'"
        )
    raise ValueError(
        f"d3: unknown damping {damping!r}; use 'bj', 'bjm' (rational damping) or 'zero'"
    )


def d3_zero(
    functional: str = "pbe", cutoff: float = 15.0, smoothing_fraction: float = 0.2
) -> BaseModelMixin:
    """DFT-D3 with zero damping: ``d3(functional, damping="zero", ...)``.

    Parameters
    ----------
    functional : str
        The DFT functional (see :func:`d3_parameters`).
    cutoff : float
        Real-space cutoff for pairs and coordination numbers, Å.
    smoothing_fraction : float
        Fraction of ``cutoff`` over which pair energies are tapered, [0, 1).

    Returns
    -------
    BaseModelMixin
        See :mod:`~nvalchemi_ase.models.zero_damping`.
    """
    return d3(functional, "zero", cutoff, smoothing_fraction)


def _normalized(functional: str) -> str:
    """s-dftd3's normalisation of a functional name: lower case, no hyphens."""
    return functional.strip().lower().replace("-", "")


def _tad_folder() -> Path:
    """tad-dftd3's package folder, found without importing it."""
    spec = importlib.util.find_spec("tad_dftd3")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "d3 needs tad-dftd3 for its reference tables and functional "
            "parameters: pip install 'nvalchemi-ase[d3]'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _tad_version() -> str:
    _tad_folder()
    return importlib.metadata.version("tad-dftd3")


_TABLES: dict[str, Any] = {}


def _functional_tables() -> tuple[dict[str, Any], dict[str, str]]:
    """s-dftd3's ``parameters.toml`` and the aliases, as tad-dftd3 ships them."""
    if not _TABLES:
        folder = _tad_folder() / "param"
        with open(folder / "parameters.toml", "rb") as handle:
            _TABLES["parameters"] = tomllib.load(handle)
        with open(folder / "aliases.toml", "rb") as handle:
            aliases = tomllib.load(handle).get("alias", {})
        _TABLES["aliases"] = {_normalized(k): v for k, v in aliases.items()}
    return _TABLES["parameters"], _TABLES["aliases"]


def _write_atomically(path: Path, tables: dict[str, torch.Tensor]) -> None:
    handle, partial = tempfile.mkstemp(dir=path.parent, suffix=".partial")
    os.close(handle)
    try:
        torch.save(tables, partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def register_models() -> None:
    """Add ``"d3"`` and ``"d3-zero"`` to the model registry."""
    registry.register(
        registry.ModelInfo(
            name="d3",
            factory=d3,
            summary=(
                "DFT-D3(BJ) dispersion, two-body (nvalchemiops' kernel), by functional"
            ),
            elements="H-Ra, Th (89)",
            cutoff="15 Å, smoothed from 12 Å (parameters)",
            dtype="any (kernel float32)",
            licence="Apache-2.0 (nvalchemi; tables: tad-dftd3)",
            extra="d3",
            weights="tables ship in the tad-dftd3 wheel",
            aliases=("dftd3", "d3bj", "d3-bj"),
        )
    )
    registry.register(
        registry.ModelInfo(
            name="d3-zero",
            factory=d3_zero,
            summary=(
                "DFT-D3 with zero damping, two-body (edge-vector model), by functional"
            ),
            elements="H-Lr (103)",
            cutoff="15 Å, smoothed from 12 Å (parameters)",
            dtype="any (the batch's)",
            licence="Apache-2.0 (tables: tad-dftd3, tad-mctc)",
            extra="d3",
            weights="tables ship in the tad-dftd3 and tad-mctc wheels",
            aliases=("d3zero",),
        )
    )
