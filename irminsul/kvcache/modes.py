"""The reuse modes an engine runs in (`KVCacheManager`): off (every prompt computed in full), prefix
(an exact-prefix radix cache), naive (content hits reused as they were computed, no re-encoding: a
baseline) and pic (content hits at any position, k_r re-encoded at the new one). A module of its own
so that the command line names them without loading the engine."""

MODES = ("off", "prefix", "naive", "pic")
