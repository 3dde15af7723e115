"""``kvgate calibrate``: measure a live engine and fit the performance model to it.

:mod:`~gateway.calibrate.probes` designs the probe set and runs it through
:mod:`~gateway.calibrate.client`; :mod:`~gateway.calibrate.fit` fits the
prefill and decode constants (non-negative least squares); and
:mod:`~gateway.calibrate.profile` writes them as a preset file.
"""

from gateway.calibrate.fit import (
    DecodeSample,
    FitError,
    FitResult,
    PrefillSample,
    fit_decode,
    fit_prefill,
)
from gateway.calibrate.profile import ProfileSource, build_profile, write_profile

__all__ = [
    "DecodeSample",
    "FitError",
    "FitResult",
    "PrefillSample",
    "ProfileSource",
    "build_profile",
    "fit_decode",
    "fit_prefill",
    "write_profile",
]
