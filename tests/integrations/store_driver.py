"""One vLLM + Irminsul engine with store tiers in this process, for test_vllm_stores.py (each engine in its
own process, as a restart or another replica would be):
`python -m tests.integrations.store_driver CKPT JOB` (from the clone's root), JOB a JSON object:

- "extra": the connector's kv_connector_extra_config ("stores": ["disk:PATH", "redis://..."], ...);
- "requests": served one at a time, in order: {"doc": seed, "header": seed, "salt": cache_salt or null};
  a prompt is a header (40 + 5 x seed tokens) + a document (600 tokens) + its question (8 tokens);
- "pause": {"before": i, "pid": p}: before request i, stop process p with SIGSTOP (a Redis that hangs).

The engine is shut down as vLLM shuts it down (the connector writes down what it queued), then one
line is printed: RESULT and a JSON object with each request's tokens, first-token log-probabilities and
connector counts, and each store tier's counters.
"""

import dataclasses
import json
import os
import signal
import sys

import numpy as np
import torch

from irminsul.integrations.vllm.connector import INSTANCES
from tests.support.moved import make_vllm

DOC = 600


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def prompt(doc: int, header: int) -> list[int]:
    return _ids(1000 + header, 40 + 5 * header) + _ids(doc, DOC) + _ids(500 + doc, 8)


def run(path: str, job: dict) -> dict:
    from vllm import SamplingParams

    llm = make_vllm(path, irminsul=True, connector_extra=job["extra"])
    scheduler, worker = INSTANCES["scheduler"][-1], INSTANCES["worker"][-1]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5, ignore_eos=True)
    pause = job.get("pause")
    out = []
    for i, asked in enumerate(job["requests"]):
        if pause and pause["before"] == i:
            os.kill(pause["pid"], signal.SIGSTOP)
        request = {"prompt_token_ids": prompt(asked["doc"], asked["header"])}
        if asked.get("salt"):
            request["cache_salt"] = asked["salt"]
        done = llm.generate([request], params, use_tqdm=False)[0]
        stats = next(v for k, v in scheduler.stats.items() if k.split("-")[0] == done.request_id)
        first = done.outputs[0].logprobs[0]
        out.append(
            {
                **asked,
                "token_ids": list(done.outputs[0].token_ids),
                "logprobs": {str(t): lp.logprob for t, lp in first.items()},
                **dataclasses.asdict(stats),
            }
        )
    counters = {"fetched_rows": worker.fetched_rows, "missed_rows": worker.missed_rows}
    llm.llm_engine.engine_core.shutdown()  # (vLLM's shutdown: the scheduler's, then the connector's)
    tiers = getattr(scheduler.index.registry, "all_tier_stats", [])
    return {"requests": out, "worker": counters, "tiers": [dataclasses.asdict(t) for t in tiers]}


def main() -> int:
    torch.set_num_threads(1)
    result = run(sys.argv[1], json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
