"""Sums over time origins at every lag: the kernel of MSD, VACF and stress ACF.

Every time-correlation analysis here reduces a series ``x_t`` (T samples of M
rows of C components, e.g. M atoms × 3 velocity components) to per-lag sums over
all time origins, summed over the components and over the rows of each group
(a structure, or one element of a structure)::

    product:  S[k, g] = Σ_t Σ_{m∈g} Σ_c x[t, m, c] · x[t+k, m, c]
    msd:      S[k, g] = Σ_t Σ_{m∈g} Σ_c (x[t+k, m, c] - x[t, m, c])²

with ``t = 0 .. T-k-1`` and ``k = 0 .. window-1``; ``counts[k] = T - k`` origins.
Dividing by the counts (and the group's size) gives the average over origins.

Two ways compute the same sums:

* :func:`lag_sums` for a whole series at once, by FFT (Wiener–Khinchin; the MSD
  by the FFT algorithm of Kneller et al., Comput. Phys. Commun. 91, 191 (1995));
  cost O(T log T) per row.
* :class:`WindowedLagSums` on the fly, one sample at a time, keeping only the
  last ``window`` samples (a ring buffer): memory O(window × M × C) whatever
  the run length; cost O(window × M × C) per sample.

Both also keep the sums of independent **blocks** (consecutive, non-overlapping
segments of ``block_length`` samples, pairs of samples inside one block only;
an incomplete last block is left out), from which the analyses estimate their
uncertainty as the standard error of the block estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Kind", "LagSums", "WindowedLagSums", "lag_sums"]

Kind = Literal["product", "msd"]

#: Largest number of float64 values one FFT chunk holds (rows are chunked).
_CHUNK_VALUES = 1 << 23


@dataclass(frozen=True)
class LagSums:
    """Per-lag sums over time origins, per group, whole series and blocks.

    Attributes
    ----------
    total : torch.Tensor, shape (W, G), float64
        Sums over all origins at lags ``0 .. W-1``.
    counts : torch.Tensor, shape (W,), float64
        Origins per lag, ``T - k``.
    blocks : torch.Tensor, shape (n_blocks, W, G), float64
        The same sums within each complete block.
    block_counts : torch.Tensor, shape (W,), float64
        Origins per lag within one block, ``block_length - k``.
    """

    total: torch.Tensor
    counts: torch.Tensor
    blocks: torch.Tensor
    block_counts: torch.Tensor

    def select(self, groups: torch.Tensor) -> LagSums:
        """Keep only the given group columns.

        Parameters
        ----------
        groups : torch.Tensor, shape (G',), int
            Column indices.

        Returns
        -------
        LagSums
            Sums of those groups only.
        """
        return LagSums(
            self.total[:, groups],
            self.counts,
            self.blocks[:, :, groups],
            self.block_counts,
        )


def check_window(window: int, block_length: int, n_samples: int | None) -> None:
    """Raise unless ``1 <= window <= block_length`` (and ``<= n_samples``).

    Parameters
    ----------
    window : int
        Number of lags W.
    block_length : int
        Samples per block.
    n_samples : int or None
        Samples in the series, when known.
    """
    if int(window) != window or window < 1:
        raise ValueError(f"window must be a positive integer, got {window}")
    if int(block_length) != block_length or block_length < window:
        raise ValueError(
            f"block_length ({block_length}) must be an integer >= window ({window})"
        )
    if n_samples is not None and n_samples < window:
        raise ValueError(
            f"window ({window} lags) is longer than the series ({n_samples} samples)"
        )


def lag_sums(
    x: torch.Tensor,
    groups: torch.Tensor,
    n_groups: int,
    window: int,
    block_length: int,
    kind: Kind,
) -> LagSums:
    """Sum over origins a whole series, by FFT (see the module docstring).

    Parameters
    ----------
    x : torch.Tensor, shape (T, M, C)
        The series (converted to float64).
    groups : torch.Tensor, shape (M,), int
        Group of each row, ``0 .. n_groups-1``.
    n_groups : int
        Number of groups G.
    window : int
        Number of lags W (``W <= block_length <= T``).
    block_length : int
        Samples per block.
    kind : {"product", "msd"}
        Which sum.

    Returns
    -------
    LagSums
        Sums of the whole series and of its ``T // block_length`` blocks.
    """
    x = x.to(torch.float64)
    n_samples = int(x.shape[0])
    check_window(window, block_length, n_samples)
    groups = groups.to(device=x.device, dtype=torch.long)
    total = _group_sums(x[None], groups, n_groups, window, kind)[0]
    n_blocks = n_samples // block_length
    blocked = x[: n_blocks * block_length].reshape(n_blocks, block_length, *x.shape[1:])
    blocks = _group_sums(blocked, groups, n_groups, window, kind)
    lags = torch.arange(window, dtype=torch.float64, device=x.device)
    return LagSums(total, n_samples - lags, blocks, block_length - lags)


def _group_sums(
    x: torch.Tensor, groups: torch.Tensor, n_groups: int, window: int, kind: Kind
) -> torch.Tensor:
    """(S, T, M, C) series → (S, W, G) sums, rows chunked to bound memory."""
    series, length, rows, components = x.shape
    out = torch.zeros(series, window, n_groups, dtype=torch.float64, device=x.device)
    per_row = max(1, series * 2 * length * components)
    step = max(1, _CHUNK_VALUES // per_row)
    for start in range(0, rows, step):
        chunk = x[:, :, start : start + step]
        sums = _row_sums(chunk, window, kind)  # (S, W, rows)
        out.index_add_(2, groups[start : start + step], sums)
    return out


def _row_sums(x: torch.Tensor, window: int, kind: Kind) -> torch.Tensor:
    """(S, T, m, C) → (S, W, m) per-row sums over origins and components."""
    length = x.shape[1]
    if kind == "msd":
        x = x - x[:, :1]  # shift-invariant; keeps the FFT's round-off small
    size = 1 << (2 * length - 1).bit_length()
    spectrum = torch.fft.rfft(x, n=size, dim=1)
    products = torch.fft.irfft(spectrum * spectrum.conj(), n=size, dim=1)
    products = products[:, :window].sum(dim=3)  # (S, W, m): Σ_t x_t · x_{t+k}
    if kind == "product":
        return products
    squares = (x * x).sum(dim=3)  # (S, T, m)
    running = torch.cumsum(squares, dim=1)
    lags = torch.arange(window, device=x.device)
    early = running[:, length - 1 - lags]  # Σ_{t=0}^{T-k-1} |x_t|²
    before = torch.cat([torch.zeros_like(running[:, :1]), running], dim=1)[:, lags]
    late = running[:, -1:] - before  # Σ_{t=k}^{T-1} |x_t|²
    return early + late - 2.0 * products


class WindowedLagSums:
    """The sums of :func:`lag_sums`, accumulated one sample at a time.

    Parameters
    ----------
    groups : torch.Tensor, shape (M,), int
        Group of each row (on the device the samples will be on).
    n_groups : int
        Number of groups G.
    window : int
        Number of lags W kept (ring buffer of W samples).
    block_length : int
        Samples per block (``>= window``).
    kind : {"product", "msd"}
        Which sum.
    """

    def __init__(
        self,
        groups: torch.Tensor,
        n_groups: int,
        window: int,
        block_length: int,
        kind: Kind,
    ) -> None:
        check_window(window, block_length, None)
        self.groups = groups.to(torch.long)
        self.n_groups = int(n_groups)
        self.window = int(window)
        self.block_length = int(block_length)
        self.kind: Kind = kind
        self.n_samples = 0
        self._buffer: torch.Tensor | None = None
        device = self.groups.device
        zeros = torch.zeros(window, n_groups, dtype=torch.float64, device=device)
        self._total = zeros
        self._block = zeros.clone()
        self._blocks: list[torch.Tensor] = []

    def update(self, sample: torch.Tensor) -> None:
        """Add one sample.

        Parameters
        ----------
        sample : torch.Tensor, shape (M, C)
            The next sample of the series (converted to float64).
        """
        sample = sample.detach().to(torch.float64)
        if self._buffer is None:
            self._buffer = torch.zeros(
                self.window, *sample.shape, dtype=torch.float64, device=sample.device
            )
        slot = self.n_samples % self.window
        self._buffer[slot] = sample
        lags = min(self.n_samples, self.window - 1) + 1
        offsets = torch.arange(lags, device=sample.device)
        past = self._buffer[(slot - offsets) % self.window]  # (K, M, C)
        if self.kind == "product":
            values = (past * sample).sum(dim=2)
        else:
            difference = sample - past
            values = (difference * difference).sum(dim=2)
        sums = torch.zeros(
            lags, self.n_groups, dtype=torch.float64, device=sample.device
        )
        sums.index_add_(1, self.groups, values)
        self._total[:lags] += sums
        within = self.n_samples % self.block_length + 1  # lags inside this block
        inside = min(lags, within)
        self._block[:inside] += sums[:inside]
        if within == self.block_length:
            self._blocks.append(self._block)
            self._block = torch.zeros_like(self._total)
        self.n_samples += 1

    def result(self) -> LagSums:
        """Return the sums so far.

        Returns
        -------
        LagSums
            As :func:`lag_sums` on the samples given.

        Raises
        ------
        ValueError
            When fewer samples than ``window`` were given.
        """
        check_window(self.window, self.block_length, self.n_samples)
        device = self._total.device
        lags = torch.arange(self.window, dtype=torch.float64, device=device)
        blocks = (
            torch.stack(self._blocks)
            if self._blocks
            else self._total.new_zeros(0, self.window, self.n_groups)
        )
        return LagSums(
            self._total.clone(),
            self.n_samples - lags,
            blocks,
            self.block_length - lags,
        )
