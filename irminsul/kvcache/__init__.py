"""The reuse layer: everything that decides which rows a prompt computes and which it reuses.

The bookkeeping needs no torch and works on token and slot ids: the CDC chunker (`chunker.py`), the
content registry (`registry.py`), the S1 window index (`windows.py`), the exact-prefix radix tree
(`radix.py`) and the reuse planner (`planner.py`). Around it sit the KV cache's owner: the latent pool
(`pool.py`), the one eviction order over rows only caches hold (`eviction.py`), tenants' namespaces
(`namespaces.py`), the journal a fleet router reads (`journal.py`), the store tiers that serialise rows
(`store/`, behind `registry.ChunkStore`), what each reuse mode caches (`caches.py`), pic+r's choice of
rows to recompute (`recompute.py`), and the KV manager (`manager.py`, options in `config.py`), which
turns plans into the admissions it hands the engine's scheduler (`admission.py`). Nothing here
imports the engine.
"""
