"""Research tools over the engine, not part of it: trace building and the recovery census
(`workloads`), the fidelity study (`eval`), training the bundled reference models (`train`), and
the `irminsul bench serve` load client (`bench_serve`). The serving path (server, engine, model,
cache) imports nothing from here (tests/test_layout.py)."""
