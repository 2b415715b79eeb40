"""vLLM-CPU's reference MLA backend, taught to compute several tokens after rows already in the cache.

`CPUMLABackend` (vllm/v1/attention/backends/mla/cpu_mla.py) prefills with SDPA over the new tokens
only (no chunked context: the CPU platform turns chunked prefill off for MLA), so a compute span after
loaded rows cannot go through it. Its decode kernel (`mla_decode_kvcache_cpu`: absorbed MQA over a
request's cached rows) can: a span of L tokens after a context of C rows is L "decodes" sharing the
request's block table, token j seeing C + j + 1 rows (causal by construction; the step's rows are
written to the cache before attention). `enable(threshold)` swaps in a metadata builder that classes
requests of up to `threshold` new tokens as decodes (`QueryLenSupport.VARLEN`) and expands their
decode metadata per token; the connector's scheduler side cuts compute spans after a load to
`threshold` tokens. Longer fresh prefills (no rows before them) keep the SDPA path.
"""

from __future__ import annotations

import torch

_ENABLED: dict[str, int] = {}


def enable(threshold: int) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    if _ENABLED.get("threshold") == threshold:
        return
    base = _ENABLED.setdefault("base", CPUMLABackend.get_builder_cls())  # (the original, once)

    class IrminsulCPUMLABuilder(base):
        query_len_support = QueryLenSupport.VARLEN
        reorder_batch_threshold = threshold

        def _build_decode(
            self,
            block_table_tensor,
            seq_lens_device,
            max_seq_len,
            query_start_loc_cpu,
            query_start_loc_device,
            num_decode_tokens,
            max_query_len,
            dcp_tot_seq_lens_device,
        ):
            starts = query_start_loc_cpu.to(torch.long)
            lens = starts[1:] - starts[:-1]
            if len(lens) and int(lens.max()) > 1:
                req = torch.repeat_interleave(torch.arange(len(lens)), lens)
                j = torch.arange(int(lens.sum())) - starts[:-1][req]  # the token's place in its request's query
                seq = seq_lens_device.to(torch.long).cpu()[req] - lens[req] + j + 1
                block_table_tensor = block_table_tensor[req.to(block_table_tensor.device)]
                seq_lens_device = seq.to(seq_lens_device.dtype).to(seq_lens_device.device)
            return super()._build_decode(
                block_table_tensor,
                seq_lens_device,
                max_seq_len,
                query_start_loc_cpu,
                query_start_loc_device,
                num_decode_tokens,
                max_query_len,
                dcp_tot_seq_lens_device,
            )

    CPUMLABackend.get_builder_cls = staticmethod(lambda: IrminsulCPUMLABuilder)
    _ENABLED["threshold"] = threshold
