"""``kvgate epp``: kvgate as the Endpoint Picker behind Envoy (Gateway API Inference Extension).

Envoy's ext_proc filter streams each request's headers and body here
(``envoy.service.ext_proc.v3.ExternalProcessor``); kvgate parses the body as ``kvgate
serve`` does, routes with the same routing service, and answers the engine to use:

* header ``x-gateway-destination-endpoint`` and dynamic metadata ``envoy.lb`` /
  ``x-gateway-destination-endpoint``, one value in both: ``ip:port`` of the chosen
  engine, then its fallbacks (``ip:port,ip:port,...``);
* in a disaggregated (P/D) pool, also ``x-prefiller-host-port: ip:port`` — llm-d's
  routing-sidecar convention: the destination is the decode engine, whose sidecar runs
  the prefill leg on the named prefill engine first (a client's own value of that header
  is always removed);
* kvgate's refusals as an ``ImmediateResponse`` (503 when no endpoint is eligible, 429
  when a router queue is full, and the proxy's 4xx for bad requests), OpenAI-shaped
  (Anthropic-shaped on ``/v1/messages``).

Envoy's response events close each request's accounting; see :mod:`gateway.epp.stream`,
:mod:`gateway.epp.accounting` and ``docs/gateway.md`` ("kvgate epp").
"""

from gateway.epp.server import EppOptions, EppServer

__all__ = ["EppOptions", "EppServer"]
