"""An nvalchemi model that evaluates an ASE calculator, structure by structure.

ASE's own tests relax and integrate EMT copper, Morse dimers, an ideal gas...:
potentials nvalchemi does not have. Wrapping the very calculator a test builds
keeps every number the test expects, so what is tested is the dynamics class
around it (this package's, swapped in by :mod:`tests.ase_suite.plugin`). The
model runs on the host, one structure at a time: a test double, not a fast path.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, PropertyNotImplementedError
from ase.stress import voigt_6_to_full_3x3_stress
from nvalchemi.models.base import BaseModelMixin, ModelConfig


class AseCalculatorModel(torch.nn.Module, BaseModelMixin):
    """Energy, forces and (where the calculator has it) stress of ``calculator``.

    Parameters
    ----------
    calculators : list of ase.calculators.calculator.Calculator
        The calculator of each structure of the run, in batch order (the
        test's own objects: their call counts and state are the test's). A
        batch of one structure, or a run over one structure, uses the first.
    """

    def __init__(self, calculators: list[Calculator]) -> None:
        super().__init__()
        self.calculators = list(calculators)
        implemented = set(getattr(calculators[0], "implemented_properties", ()))
        outputs = {"energy", "forces"} | ({"stress"} & implemented)
        self.model_config = ModelConfig(
            outputs=frozenset(outputs),
            autograd_outputs=frozenset(),
            autograd_inputs=frozenset(),
            supports_pbc=True,
            needs_pbc=False,
        )
        self.register_buffer("_dtype_anchor", torch.zeros(1, dtype=torch.float64))

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("an ASE calculator has no embeddings")

    def _calculator_for(self, index: int, count: int) -> Calculator:
        if count == len(self.calculators):
            return self.calculators[index]
        if len(self.calculators) == 1:
            return self.calculators[0]
        raise RuntimeError(
            f"a batch of {count} structures over {len(self.calculators)} calculators"
        )

    def forward(self, data: Any, **kwargs: Any) -> OrderedDict[str, torch.Tensor]:
        positions = data.positions.detach()
        dtype, device = positions.dtype, positions.device
        ptr = data.batch_ptr.detach().cpu().numpy()
        numbers = data.atomic_numbers.detach().cpu().numpy()
        host_positions = positions.cpu().double().numpy()
        cells = data.cell.detach().cpu().double().numpy()
        pbc = data.pbc.detach().cpu().numpy().reshape(len(ptr) - 1, 3)
        wanted = set(self.model_config.active_outputs)
        energies, forces, stresses = [], [], []
        for index in range(len(ptr) - 1):
            start, stop = int(ptr[index]), int(ptr[index + 1])
            atoms = Atoms(
                numbers=numbers[start:stop],
                positions=host_positions[start:stop],
                cell=cells[index],
                pbc=pbc[index],
            )
            calc = self._calculator_for(index, len(ptr) - 1)
            energies.append(calc.get_property("energy", atoms))
            forces.append(calc.get_property("forces", atoms))
            if "stress" in wanted:
                try:
                    stress = voigt_6_to_full_3x3_stress(
                        calc.get_property("stress", atoms)
                    )
                except (PropertyNotImplementedError, ValueError):
                    stress = np.zeros((3, 3))
                stresses.append(stress)
        output: OrderedDict[str, torch.Tensor] = OrderedDict()
        output["energy"] = torch.tensor(energies, dtype=dtype, device=device)[:, None]
        output["forces"] = torch.tensor(
            np.concatenate(forces) if forces else np.zeros((0, 3)),
            dtype=dtype,
            device=device,
        )
        if "stress" in wanted:
            output["stress"] = torch.tensor(
                np.array(stresses), dtype=dtype, device=device
            )
        return output
