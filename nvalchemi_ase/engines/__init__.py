"""Batched nvalchemi engines for ASE algorithms nvalchemi 0.3 does not have.

Each class is an ``nvalchemi.dynamics.base.BaseDynamics`` subclass following
nvalchemi's recipe (``__needs_keys__``/``__provides_keys__``,
``pre_update``/``post_update`` under ``torch.no_grad()``, per-structure state in
``self._state``), so it runs on a ``Batch`` with nvalchemi's hooks, convergence
checks and ``status`` masking, and (through :mod:`nvalchemi_ase.md` and
:mod:`nvalchemi_ase.optimize`) from ASE.

=======================  =========================  ==================================
engine                   ASE algorithm              ASE-style class
=======================  =========================  ==================================
``ASEFIRE``              ``ase.optimize.FIRE``      ``nvalchemi_ase.optimize.FIRE``
``ABCFIRE2``             ``ase.optimize.FIRE2``     ``nvalchemi_ase.optimize.FIRE2``
                         (``use_abc=True``)         (``use_abc=True``)
``ASEBFGS``              ``ase.optimize.BFGS``      ``nvalchemi_ase.optimize.BFGS``
``ASEMDMin``             ``ase.optimize.MDMin``     ``nvalchemi_ase.optimize.MDMin``
``NVTBussi``             ``ase.md.bussi.Bussi``     ``nvalchemi_ase.md.Bussi``
``NVTBerendsen``         ``ase.md.nvtberendsen``    ``nvalchemi_ase.md.NVTBerendsen``
``NVTAndersen``          ``ase.md.andersen``        ``nvalchemi_ase.md.Andersen``
``LangevinHooverBAOAB``  ``ase.md.langevinbaoab``   ``nvalchemi_ase.md.LangevinBAOAB``
``ChainNPT``             ``ase.md.nose_hoover_      ``nvalchemi_ase.md.MTKNPT`` and
                         chain`` (MTK NPT)          ``IsotropicMTKNPT``
=======================  =========================  ==================================

The optimizer engines carry an ``ASE`` prefix: ``ASEFIRE`` is ASE's FIRE step
for step, unlike nvalchemi's own ``FIRE`` engine, and neither is the ASE-style
class ``nvalchemi_ase.optimize.FIRE`` that drives it.

``ChainNPT`` is nvalchemi's own ``NPT`` engine (its kernels and splitting)
with a separate length for the barostat's Nosé-Hoover chain.

Units follow nvalchemi: integrator time steps and coupling times in fs,
temperatures in K (``KB_EV``), velocities in Å per ASE time unit; the
optimizers' ``dt`` (FIRE, MDMin) is in the internal (= ASE) time unit, as for
nvalchemi's FIRE. Importing this package imports nvalchemi; the ASE-style
classes import it lazily through :func:`nvalchemi_ase._quiet.import_quietly`.
"""

from nvalchemi_ase.engines.andersen import NVTAndersen
from nvalchemi_ase.engines.berendsen import NVTBerendsen
from nvalchemi_ase.engines.bfgs import ASEBFGS
from nvalchemi_ase.engines.bussi import NVTBussi
from nvalchemi_ase.engines.fire import ASEFIRE
from nvalchemi_ase.engines.fire2 import ABCFIRE2
from nvalchemi_ase.engines.langevin_hoover import LangevinHooverBAOAB
from nvalchemi_ase.engines.mdmin import ASEMDMin
from nvalchemi_ase.engines.mtk import ChainNPT

__all__ = [
    "ABCFIRE2",
    "ASEBFGS",
    "ASEFIRE",
    "ASEMDMin",
    "ChainNPT",
    "LangevinHooverBAOAB",
    "NVTAndersen",
    "NVTBerendsen",
    "NVTBussi",
]
