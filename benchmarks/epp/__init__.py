"""kvgate as Envoy's endpoint picker: throughput and the latency of the ext_proc hop."""
