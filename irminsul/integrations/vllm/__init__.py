"""Irminsul's position-independent reuse inside vLLM (the `irminsul[vllm]` extra; docs/vllm.md).

`spans` is engine-agnostic (Irminsul's planner and registry behind token ids and fingerprints);
`connector` (a v1 KV connector) and `scheduler` (a Scheduler subclass) import vLLM.
"""

CONNECTOR = {"kv_connector": "IrminsulConnector",
             "kv_connector_module_path": "irminsul.integrations.vllm.connector",
             "kv_role": "kv_both"}
SCHEDULER = "irminsul.integrations.vllm.scheduler.IrminsulScheduler"
