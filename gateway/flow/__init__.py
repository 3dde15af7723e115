"""Flow control: admission, priority and fairness in front of every policy (pure).

:mod:`.identity` (tenant and priority of a request), :mod:`.queue` (the fair priority
queue), :mod:`.saturation` (when the engines are saturated), :mod:`.controller` (admit,
queue, shed, time out). The gateway's async wrapper is :mod:`gateway.proxy.flow_gate`;
the simulator drives the same controller in virtual time.
"""

from gateway.flow.controller import Admission, FlowController, FlowOutcome, FlowSettings, FlowStats
from gateway.flow.identity import PriorityError, key_tenant, priority_of, tenant_of
from gateway.flow.queue import FairQueue, FlowItem
from gateway.flow.saturation import SaturationDetector, SaturationSettings

__all__ = [
    "Admission",
    "FairQueue",
    "FlowController",
    "FlowItem",
    "FlowOutcome",
    "FlowSettings",
    "FlowStats",
    "PriorityError",
    "SaturationDetector",
    "SaturationSettings",
    "key_tenant",
    "priority_of",
    "tenant_of",
]
