"""A fake Kubernetes API server for InferencePool discovery: InferencePools
(``inference.networking.k8s.io/v1``) and Pods, listed and watched on 127.0.0.1 by
:class:`fake_kube.FakeApiServer` (``failures[resource]`` holds statuses for the next requests
of a resource). Serve it with :func:`fake_kube.serve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fake_kube import FakeApiServer, Resource

POOLS = "inferencepools"
PODS = "pods"


def inference_pool(
    name: str, labels: dict[str, str], ports: list[int], namespace: str = "inference"
) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


def pod(
    name: str,
    ip: str | None,
    labels: dict[str, str],
    *,
    ready: bool = True,
    deleting: bool = False,
    namespace: str = "inference",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    state: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip is not None:
        state["podIP"] = ip
        state["podIPs"] = [{"ip": ip}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": state}


@dataclass
class FakePoolApi(FakeApiServer):
    """InferencePools and Pods; change them with put/delete."""

    RESOURCES: ClassVar[dict[str, Resource]] = {
        POOLS: Resource(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            "InferencePoolList",
            "inference.networking.k8s.io/v1",
        ),
        PODS: Resource("/api/v1/namespaces/{ns}/pods", "PodList"),
    }

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        self.put_object(resource, obj)

    def delete(self, resource: str, name: str) -> None:
        self.delete_object(resource, name)
