"""The KV cache's owner: the latent pool (`pool.py`), the one eviction order over rows only caches hold
(`eviction.py`), tenants' namespaces (`namespaces.py`) and the KV manager that turns the cache's plans
into slot tables (`manager.py`). The bookkeeping it drives (chunker, registry, radix tree, windows,
planner) is engine-agnostic and lives in `irminsul/cache/`."""
