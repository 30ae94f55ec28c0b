"""Closed-loop planning: the cost model learns the cluster it runs on.

Beside the cost model (:mod:`balanced_loader.cost`, contract 2): each rank records what it measured
per microbatch (:mod:`.samples`), the ranks all-gather the window, and every few steps the same
fit on every rank gives new contract-2 coefficients per device class and shape (:mod:`.fit`) and a
speed per rank (:mod:`.speeds`), which the loader plans with from a step every rank knows
(:mod:`.calibrator`). The runtime does this with ``train.calibrate: true``; a user's own loop with
``BalancedLoader(..., calibrate=True)`` and ``loader.observe(batch, timer.samples())``.
"""

from balanced_loader.calibration.calibrator import CalibrationOptions, Calibrator, Update
from balanced_loader.calibration.samples import MicrobatchTimer, Samples, gather_samples, sample_rows

__all__ = ["CalibrationOptions", "Calibrator", "MicrobatchTimer", "Samples", "Update", "gather_samples",
           "sample_rows"]
