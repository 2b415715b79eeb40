"""How many threads one request runs fastest with on this machine: all of torch's, or one.

More threads split each product and each attention call, and cost a fork and a join per operation;
a small model's decode step is mostly such operations, a large model's mostly work to split. Which wins
depends on the model and the CPU, so `fastest_threads` times one request both ways on the loaded model
(a prompt of PROBE_PROMPT tokens and PROBE_DECODE decode steps, eager, interleaved rounds) and keeps the
answer with the kernel choices' times (`kernel_choice`, per CPU), keyed by the checkpoint and the
thread count torch started with. `irminsul serve` without `--threads` runs with the faster one.
"""

from __future__ import annotations

import time

import torch

from irminsul.model import kernel_choice
from irminsul.model.deepseek import DeepseekModel

PROBE_PROMPT = 64
PROBE_DECODE = 16
ROUNDS = 3


def fastest_threads(model, key: str) -> int:
    """1 or torch's current thread count, whichever ran the probe request faster (measured once per
    `key`: a checkpoint and dtype). Other families than the MLA models (their row-level interface,
    `new_rows`/`prefill`, is what is timed) and models off the CPU keep the current count."""
    start = torch.get_num_threads()
    if start == 1 or not isinstance(model, DeepseekModel) or model.device.type != "cpu":
        return start
    entry = kernel_choice._measured(
        f"threads|{key}|from{start}", "threads", lambda: _probe(model, start), model.settings
    )
    return int(entry["threads"])


def _request(model, ids: list[int]) -> float:
    """Seconds of one probe request: a prompt of ids, then PROBE_DECODE decode steps."""
    t = time.perf_counter()
    seq = model.new_rows(len(ids) + PROBE_DECODE + 1)
    model.logits(model.prefill(seq, ids, list(range(len(ids)))))
    for i in range(PROBE_DECODE):
        model.logits(model.prefill(seq, [5], [len(ids) + i]))
    return time.perf_counter() - t


def _probe(model, start: int) -> dict:
    ids = [3 + i % 200 for i in range(PROBE_PROMPT)]
    times: dict[int, list[float]] = {1: [], start: []}
    try:
        with torch.inference_mode():
            for n in (1, start):  # (warm both: the first calls build kernels and buffers)
                torch.set_num_threads(n)
                _request(model, ids)
            for r in range(ROUNDS):
                for n in (1, start) if r % 2 else (start, 1):
                    torch.set_num_threads(n)
                    times[n].append(_request(model, ids))
    finally:
        torch.set_num_threads(start)
    one, all_ = (kernel_choice._typical(times[n]) for n in (1, start))
    return {"threads": 1 if one < all_ else start, "one_s": one, "all_s": all_}
