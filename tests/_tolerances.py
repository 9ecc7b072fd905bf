"""Named tolerances, per dtype where precision matters (never library defaults)."""

import torch

# Agreement of two evaluations of the same analytic model (round-off only).
EXACT = {torch.float64: 1e-10, torch.float32: 1e-4}
# Finite-difference forces, eV/Å, central differences with FD_STEP.
FD_STEP = 1e-5
FD_FORCE_ATOL = {torch.float64: 1e-6, torch.float32: 5e-3}
# Finite-difference stress, eV/Å³, strain step FD_STRAIN.
FD_STRAIN = 1e-6
FD_STRESS_ATOL = {torch.float64: 1e-8, torch.float32: 1e-4}
# Bitwise-level agreement between batched and one-by-one float64 evaluations.
BATCH_VS_SINGLE_RTOL = 1e-12
