"""Small random-weight MACE models built with mace-torch's own constructors.

Only for tests and benchmarks: the weights are random (not physics), the layout
is that of the MACE-MP foundation models (``ScaleShiftMACE``, residual
interaction blocks, Bessel radial basis with a polynomial cutoff), scaled down.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: Elements of the test model: H, C, N, O, Al, Si, Cu (molecules, slab, bulk).
TEST_ELEMENTS = (1, 6, 7, 8, 13, 14, 29)
#: Cutoff of the test model, Å.
TEST_CUTOFF = 4.5


def build_random_mace(
    elements: tuple[int, ...] = TEST_ELEMENTS,
    *,
    r_max: float = TEST_CUTOFF,
    channels: int = 8,
    max_ell: int = 1,
    correlation: int = 2,
    radial_mlp: tuple[int, ...] = (16, 16),
    num_interactions: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    heads: list[str] | None = None,
) -> torch.nn.Module:
    """A ``mace.modules.ScaleShiftMACE`` with random weights (eval mode, CPU).

    Parameters
    ----------
    elements : tuple of int
        Atomic numbers of its z table.
    r_max : float
        Cutoff, Å.
    channels : int
        Scalar and vector channels of the hidden irreps (``{c}x0e + {c}x1o``).
    max_ell : int
        Largest spherical harmonic of the edge attributes.
    correlation : int
        Body order of the product basis, minus one.
    radial_mlp : tuple of int
        Hidden widths of the radial MLP (mace's default is 64, 64, 64).
    num_interactions : int
        Message-passing layers.
    seed : int
        Seeds torch's and NumPy's generators used for the weights.
    dtype : torch.dtype
        Dtype of the weights.
    heads : list of str, optional
        Readout heads (None: mace's single ``"Default"`` head).

    Returns
    -------
    torch.nn.Module
        The model.
    """
    from e3nn import o3
    from mace import modules

    generator = np.random.default_rng(seed)
    n_heads = 1 if heads is None else len(heads)
    shape = (len(elements),) if heads is None else (n_heads, len(elements))
    extra: dict[str, object] = {
        "atomic_inter_scale": 1.3,
        "atomic_inter_shift": -0.2,
    }
    if heads is not None:
        extra = {
            "heads": heads,
            "atomic_inter_scale": [1.3 + 0.2 * i for i in range(n_heads)],
            "atomic_inter_shift": [-0.2 + 0.1 * i for i in range(n_heads)],
        }
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        model = modules.ScaleShiftMACE(
            r_max=r_max,
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=max_ell,
            interaction_cls=modules.interaction_classes[
                "RealAgnosticResidualInteractionBlock"
            ],
            interaction_cls_first=modules.interaction_classes[
                "RealAgnosticResidualInteractionBlock"
            ],
            num_interactions=num_interactions,
            num_elements=len(elements),
            hidden_irreps=o3.Irreps(f"{channels}x0e + {channels}x1o"),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=generator.uniform(-5.0, -1.0, shape),
            avg_num_neighbors=12.0,
            atomic_numbers=list(elements),
            correlation=correlation,
            radial_MLP=list(radial_mlp),
            gate=torch.nn.functional.silu,
            **extra,
        )
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def save_random_mace(path: Path, **kwargs: object) -> Path:
    """Build :func:`build_random_mace` and save it whole, as MACE saves models."""
    torch.save(build_random_mace(**kwargs), path)  # type: ignore[arg-type]
    return path


#: Arguments of the e3nn 0.4.4 fixture ``tests/data/mace_e3nn044.model``.
LEGACY_FIXTURE_ARGS: dict[str, object] = {
    "channels": 8,
    "max_ell": 1,
    "correlation": 3,
    "radial_mlp": (64, 64, 64),
    "seed": 1,
}

if __name__ == "__main__":  # writes the legacy fixture; see tests/data/README.md
    import sys

    save_random_mace(Path(sys.argv[1]), **LEGACY_FIXTURE_ARGS)
