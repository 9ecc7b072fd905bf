"""ASE's ``UnitCellFilter`` and ``FrechetCellFilter`` coordinates, batched in torch.

ASE's optimizers relax a filtered structure in generalized coordinates of
N + 3 rows (``filter.get_positions()``/``get_forces()``, from
ASE 3.29's ``CellUtility``, which the filters call). With the deformation gradient
``F = (L0⁻¹ L)ᵀ`` of the cell L (rows = lattice vectors) from the filter's
``orig_cell`` L0, per structure:

* atom rows: positions ``r F⁻ᵀ`` (in the undeformed cell), forces ``f F``;
* cell rows, ``UnitCellFilter``: position ``c F`` (c = ``cell_factor``),
  force ``W F⁻ᵀ / c`` with the virial ``W = -V (σ + p 1)``;
* cell rows, ``FrechetCellFilter``: position ``e log(N F)`` (e =
  ``exp_cell_factor``, N atoms), force ``D / e`` with D the derivative of the
  energy along ``log F``: ``D = L(log(F)ᵀ, W F⁻ᵀ)``, L the Fréchet derivative
  of the matrix exponential (the adjoint of ASE's sum over nine directions);
* the options act on W in ASE's order: ``hydrostatic_strain`` (W → tr W / 3),
  ``mask`` (W ∘ mask), ``constant_volume`` (tr / 3 off the diagonal of the
  cell force; for Fréchet after the derivative, as ASE);
* setting the coordinates: ``F' = (cell rows)/c`` (Fréchet:
  ``exp(rows / e) / c``), ``G = 1 + (F' - 1)ᵀ ∘ mask``, cell ``L0 G`` and
  positions ``x G``;
* the filter's energy is ``E + p V``;
* ``StrainFilter`` (``strain``): the atoms keep their fractional positions
  (atom rows fixed, forces zero); the first two cell rows are ASE's Voigt
  strain ε (xx yy zz / yz xz xy) with the cell ``L0 (1 + ε)`` (shear halved,
  symmetric), their forces ``-V σ`` (Voigt) times the filter's 6-mask, the
  third row is zero (ASE's filter has 2 rows; a zero row moves nothing and
  adds nothing to the norms).

Shapes: ``V`` atoms, ``B`` structures; cells and cell rows [B, 3, 3].
Inverses and determinants are cofactor formulas, not LAPACK calls: a batched
``torch.linalg.inv`` checks its result on the host (a device sync on a GPU)
and runs a thread-pool region on a CPU (measured 16 ms a call on two busy
cores, against 0.04 ms for the formula).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = [
    "CellFilterCoordinates",
    "determinant3",
    "expm",
    "expm_frechet",
    "inverse3",
    "logm",
]

#: Square roots taken before the series of ``logm`` (inverse scaling and squaring).
_SQUARE_ROOTS = 2
#: Denman-Beavers iterations per square root (quadratic convergence near 1).
_ROOT_ITERATIONS = 8
#: Odd terms of the series ``log(1 + E) = 2 atanh(E (2 + E)⁻¹)``.
_SERIES_TERMS = 12
#: Squarings and Taylor terms of ``expm`` (torch's ``matrix_exp`` costs ~10 ms
#: a call on a CPU for [B, 3, 3]; this is ~0.2 ms and exact to rounding for
#: ``|A| < 4``).
_SQUARINGS = 3
_TAYLOR_TERMS = 16


@dataclass
class CellFilterCoordinates:
    """The generalized coordinates of ASE's cell filters for a batch.

    Attributes
    ----------
    frechet : bool
        ``FrechetCellFilter`` (True) or ``UnitCellFilter`` (False).
    reference : torch.Tensor
        [B, 3, 3] the filters' ``orig_cell``, Å (rows = lattice vectors).
    cell_factor : torch.Tensor
        [B] ``cell_factor`` (the number of atoms by default).
    exp_cell_factor : torch.Tensor
        [B] ``exp_cell_factor`` of a Fréchet filter (``cell_factor`` otherwise).
    atom_count : torch.Tensor
        [B] atoms per structure (N of the Fréchet cell rows).
    pressure : torch.Tensor
        [B] ``scalar_pressure``, eV/Å³.
    hydrostatic : torch.Tensor
        [B] bool ``hydrostatic_strain``.
    constant_volume : torch.Tensor
        [B] bool.
    mask : torch.Tensor
        [B, 3, 3] 0/1 cell components that move (ASE's ``mask3x3``); for
        ``strain`` the 6-mask as rows (xx yy zz / yz xz xy / 0 0 0).
    strain : bool
        ``StrainFilter`` (True): only the cell moves, atoms keep fractional
        positions.
    """

    frechet: bool
    reference: torch.Tensor
    cell_factor: torch.Tensor
    exp_cell_factor: torch.Tensor
    atom_count: torch.Tensor
    pressure: torch.Tensor
    hydrostatic: torch.Tensor
    constant_volume: torch.Tensor
    mask: torch.Tensor
    strain: bool = False
    _reference_inverse: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._reference_inverse = inverse3(self.reference)

    def set_reference(self, reference: torch.Tensor) -> None:
        """Take other reference cells L0 [B, 3, 3], Å (a restart's ``orig_cell``)."""
        with torch.no_grad():
            self.reference.copy_(reference)
        self._reference_inverse = inverse3(self.reference)

    def deformation(self, cell: torch.Tensor) -> torch.Tensor:
        """ASE's ``deform_grad``: ``F = (L0⁻¹ L)ᵀ``, [B, 3, 3]."""
        return (self._reference_inverse @ cell).mT

    def positions(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the filter's positions: atom rows [V, 3] Å and cell rows [B, 3, 3]."""
        cell = batch.cell.detach()
        deformation = self.deformation(cell)
        index = batch.batch_idx.long()
        atoms = _row_times(batch.positions.detach(), inverse3(deformation).mT, index)
        if self.strain:
            return atoms, _strain_rows(deformation)
        if not self.frechet:
            return atoms, self.cell_factor.view(-1, 1, 1) * deformation
        identity = torch.eye(3, dtype=cell.dtype, device=cell.device)
        log_count = torch.log(self.atom_count).view(-1, 1, 1)
        rows = logm(deformation) + log_count * identity
        return atoms, self.exp_cell_factor.view(-1, 1, 1) * rows

    def set_positions(
        self, batch: Batch, atoms: torch.Tensor, cell_rows: torch.Tensor
    ) -> None:
        """Write filter positions into ``batch.positions`` and ``batch.cell``.

        Parameters
        ----------
        batch : Batch
            Updated in place.
        atoms : torch.Tensor
            [V, 3] atom rows (positions in the undeformed cell), Å.
        cell_rows : torch.Tensor
            [B, 3, 3] cell rows.
        """
        identity = torch.eye(3, dtype=atoms.dtype, device=atoms.device)
        if self.strain:
            gradient = _strain_matrix(cell_rows * self.mask, identity)
            index = batch.batch_idx.long()
            batch.cell.copy_(self.reference @ gradient)
            batch.positions.copy_(_row_times(atoms, gradient, index))
            return
        if self.frechet:  # exp(X / e) / c, the log N 1 of the rows taken out first
            log_count = torch.log(self.atom_count).view(-1, 1, 1)
            scaled = cell_rows / self.exp_cell_factor.view(-1, 1, 1)
            deformation = expm(scaled - log_count * identity)
            deformation = deformation * self.atom_count.view(-1, 1, 1)
        else:
            deformation = cell_rows
        deformation = deformation / self.cell_factor.view(-1, 1, 1)
        gradient = identity + (deformation - identity).mT * self.mask
        index = batch.batch_idx.long()
        batch.cell.copy_(self.reference @ gradient)
        batch.positions.copy_(_row_times(atoms, gradient, index))

    def forces(
        self, batch: Batch, atom_forces: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the filter's forces: atom rows [V, 3] and cell rows [B, 3, 3], eV/Å.

        Parameters
        ----------
        batch : Batch
            Supplies ``cell`` and ``stress`` [B, 3, 3] eV/Å³ (tensile positive).
        atom_forces : torch.Tensor
            [V, 3] the atoms' forces, eV/Å (frozen atoms' zero).
        """
        cell = batch.cell.detach()
        deformation = self.deformation(cell)
        identity = torch.eye(3, dtype=cell.dtype, device=cell.device)
        volume = determinant3(cell).abs().view(-1, 1, 1)
        if self.strain:
            stress = _voigt_rows(batch.stress.detach())
            return torch.zeros_like(atom_forces), -volume * stress * self.mask
        stress = batch.stress.detach() + self.pressure.view(-1, 1, 1) * identity
        virial = -volume * stress
        atoms = _row_times(atom_forces, deformation, batch.batch_idx.long())
        inverse_transpose = inverse3(deformation).mT
        if not self.frechet:
            virial = virial @ inverse_transpose
        virial = self._options(virial)
        if not self.frechet:
            return atoms, self._deviatoric(virial) / self.cell_factor.view(-1, 1, 1)
        derivative = expm_frechet(logm(deformation).mT, virial @ inverse_transpose)
        rows = self._deviatoric(derivative) / self.exp_cell_factor.view(-1, 1, 1)
        return atoms, rows

    def energy(self, batch: Batch) -> torch.Tensor:
        """Return the filter's energy ``E + p V``, [B] eV."""
        volume = determinant3(batch.cell.detach()).abs()
        return batch.energy.detach().reshape(-1) + self.pressure * volume

    def _options(self, virial: torch.Tensor) -> torch.Tensor:
        """``hydrostatic_strain`` then ``mask``, as ASE applies them to W."""
        identity = torch.eye(3, dtype=virial.dtype, device=virial.device)
        trace = virial.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1) / 3.0
        virial = torch.where(self.hydrostatic.view(-1, 1, 1), trace * identity, virial)
        return virial * self.mask

    def _deviatoric(self, force: torch.Tensor) -> torch.Tensor:
        """``constant_volume``: the trace / 3 off the diagonal, [B, 3, 3]."""
        identity = torch.eye(3, dtype=force.dtype, device=force.device)
        trace = force.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1) / 3.0
        return torch.where(
            self.constant_volume.view(-1, 1, 1), force - trace * identity, force
        )


def _strain_rows(deformation: torch.Tensor) -> torch.Tensor:
    """ASE's ``StrainFilter`` rows of ``L0⁻¹ L`` (= 1 + ε), [B, 3, 3].

    Row 0: ε_xx, ε_yy, ε_zz; row 1: the engineering shears 2 ε_yz, 2 ε_xz,
    2 ε_xy; row 2: zero.
    """
    identity = torch.eye(3, dtype=deformation.dtype, device=deformation.device)
    engineering = torch.tensor(
        [[1.0], [2.0], [0.0]], dtype=deformation.dtype, device=deformation.device
    )
    return _voigt_rows(deformation - identity) * engineering


def _voigt_rows(matrix: torch.Tensor) -> torch.Tensor:
    """Voigt rows of [B, 3, 3] matrices: (xx, yy, zz), (yz, xz, xy), (0, 0, 0)."""
    diagonal = matrix.diagonal(dim1=-2, dim2=-1)
    shear = torch.stack([matrix[:, 1, 2], matrix[:, 0, 2], matrix[:, 0, 1]], dim=-1)
    return torch.stack([diagonal, shear, torch.zeros_like(shear)], dim=1)


def _strain_matrix(rows: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
    """``1 + ε`` of (masked) ``StrainFilter`` rows; inverse of :func:`_strain_rows`."""
    xx, yy, zz = rows[:, 0].unbind(-1)
    yz, xz, xy = (0.5 * rows[:, 1]).unbind(-1)
    strain = torch.stack(
        [
            torch.stack([xx, xy, xz], dim=-1),
            torch.stack([xy, yy, yz], dim=-1),
            torch.stack([xz, yz, zz], dim=-1),
        ],
        dim=1,
    )
    return identity + strain


def logm(matrix: torch.Tensor) -> torch.Tensor:
    """Principal matrix logarithm of [B, 3, 3] matrices near the identity.

    Inverse scaling and squaring: ``_SQUARE_ROOTS`` Denman-Beavers square
    roots, then the series ``log(1 + E) = 2 Σ Z^(2k+1)/(2k+1)``,
    ``Z = E (2 + E)⁻¹``. Accurate to rounding for ``|F - 1| < 1`` (deformation
    gradients of relaxations).
    """
    identity = torch.eye(3, dtype=matrix.dtype, device=matrix.device)
    root = matrix
    for _ in range(_SQUARE_ROOTS):
        root = _square_root(root, identity)
    excess = root - identity
    z = excess @ inverse3(2.0 * identity + excess)
    z2 = z @ z
    power, total = z, z.clone()
    for k in range(1, _SERIES_TERMS):
        power = power @ z2
        total = total + power / (2 * k + 1)
    return (2.0 ** (_SQUARE_ROOTS + 1)) * total


def _square_root(matrix: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
    """Principal square root by the Denman-Beavers iteration, [B, 3, 3]."""
    y, z = matrix, identity.expand_as(matrix)
    for _ in range(_ROOT_ITERATIONS):
        y, z = 0.5 * (y + inverse3(z)), 0.5 * (z + inverse3(y))
    return y


def _row_times(
    rows: torch.Tensor, matrices: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """``rows[v] @ matrices[index[v]]`` for [V, 3] rows, [B, 3, 3] matrices.

    ``index_select`` and a broadcast product: a batched matmul over V tiny
    matrices, or ``matrices[index]``, runs a thread-pool region on a CPU
    (~20 ms a call on two busy cores, against ~0.05 ms).
    """
    per_row = matrices.reshape(-1, 9).index_select(0, index).view(-1, 3, 3)
    return (rows.unsqueeze(-1) * per_row).sum(dim=-2)


def determinant3(matrix: torch.Tensor) -> torch.Tensor:
    """Return the determinants of [B, 3, 3] matrices, [B] (``r0 · (r1 × r2)``)."""
    rows = matrix.unbind(dim=-2)
    return (rows[0] * torch.linalg.cross(rows[1], rows[2])).sum(dim=-1)


def inverse3(matrix: torch.Tensor) -> torch.Tensor:
    """Return the inverses of [B, 3, 3] matrices by cofactors, [B, 3, 3].

    With rows r0, r1, r2 the columns of the inverse are ``r1 × r2``,
    ``r2 × r0``, ``r0 × r1`` over the determinant.
    """
    r0, r1, r2 = matrix.unbind(dim=-2)
    cofactors = torch.stack(
        [
            torch.linalg.cross(r1, r2),
            torch.linalg.cross(r2, r0),
            torch.linalg.cross(r0, r1),
        ],
        dim=-1,
    )
    determinant = (r0 * cofactors[..., 0]).sum(dim=-1)
    return cofactors / determinant[..., None, None]


def expm(matrix: torch.Tensor) -> torch.Tensor:
    """Matrix exponential of [B, n, n] matrices of moderate norm.

    Scaling and squaring (``_SQUARINGS``) around a Horner-form Taylor series
    (``_TAYLOR_TERMS``): the logarithmic strains of relaxations are well
    inside its range.
    """
    identity = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    scaled = matrix / 2.0**_SQUARINGS
    result = identity + scaled / _TAYLOR_TERMS
    for k in range(_TAYLOR_TERMS - 1, 0, -1):
        result = identity + (scaled @ result) / k
    for _ in range(_SQUARINGS):
        result = result @ result
    return result


def expm_frechet(matrix: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Fréchet derivative of ``expm`` at ``matrix`` along ``direction``, [B, 3, 3].

    The upper-right block of ``expm([[A, E], [0, A]])``.
    """
    count = matrix.shape[0]
    block = matrix.new_zeros((count, 6, 6))
    block[:, :3, :3] = matrix
    block[:, 3:, 3:] = matrix
    block[:, :3, 3:] = direction
    return expm(block)[:, :3, 3:]
