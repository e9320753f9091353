"""Simulation, apart from what real runs use: latency models, simulated agents and grader, and the
pipelined driver's virtual-clock runtime (for tests, benchmarks and exactly replayed runs)."""
