"""Irminsul's position-independent reuse inside vLLM (the `irminsul[vllm]` extra; docs/vllm.md).

`spans` is engine-agnostic (Irminsul's planner and registry behind token ids and fingerprints);
`connector` (a v1 KV connector) and `scheduler` (a Scheduler subclass, for a vLLM without the upstream
change in `upstream/scheduler.patch`) import vLLM.
"""

CONNECTOR = {
    "kv_connector": "IrminsulConnector",
    "kv_connector_module_path": "irminsul.integrations.vllm.connector",
    "kv_role": "kv_both",
    # a load the worker cannot serve is a cache miss: recomputed, never a failed request
    "kv_load_failure_policy": "recompute",
}
SCHEDULER = "irminsul.integrations.vllm.scheduler.IrminsulScheduler"
