"""How fast: decision time, gateway overhead, proxy throughput, radix tree, simulator."""
