"""One vLLM + Irminsul engine in this process, for test_vllm.py (each engine in its own process):
`python -m tests.integrations.vllm_driver CKPT cycle|salts` (from the clone's root) prints one line, RESULT and a JSON object.

- cycle: a registry smaller than one document, documents each behind several new headers in turn,
  up to four requests at a time (vLLM's batch), so that chunks are evicted and stored again from
  step to step; then one more request after the worker lost every row;
- salts: documents cached under one cache_salt, asked for under another, under none, and published
  under the operator's publish_salt.
"""

import json
import sys

import numpy as np
import torch

from irminsul.integrations.vllm.connector import INSTANCES
from tests.support.moved import make_vllm

PUBLISH_SALT = "operator-secret"


def _ids(rng, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


def _stats(outputs) -> list[dict]:
    """Each output's connector counts (the engine's own request id carries a suffix after the caller's)."""
    stats = INSTANCES["scheduler"][-1].stats
    by_id = {k.split("-")[0]: v for k, v in stats.items()}
    return [vars(by_id[out.request_id]) for out in outputs]


def cycle(path: str, requests: int) -> dict:
    from vllm import SamplingParams

    bytes_per_token = 2 * 576 * 2  # (layers x row width x 2, the connector's charge)
    llm = make_vllm(path, irminsul=True, connector_extra={"registry_gib": 400 * bytes_per_token / 2**30})
    rng = np.random.default_rng(0)
    docs = [_ids(rng, 600) for _ in range(3)]
    prompts = [{"prompt_token_ids": _ids(rng, 40 + i % 7) + docs[i // 8 % 3] + _ids(rng, 8)} for i in range(requests)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    worker = INSTANCES["worker"][-1]
    result = {
        "finished": sum(len(o.outputs[0].token_ids) == 2 for o in outputs),
        "stats": _stats(outputs),
        "missed_rows": worker.missed_rows,
        "registry_entries": len(INSTANCES["scheduler"][-1].index.registry),
    }
    # then rows the registry plans but the worker lost: a miss, recomputed
    worker.rows.clear()
    missed = llm.generate(
        [{"prompt_token_ids": _ids(rng, 50) + docs[(requests - 1) // 8 % 3] + _ids(rng, 8)}], params, use_tqdm=False
    )
    result["after_loss"] = {
        "tokens": len(missed[0].outputs[0].token_ids),
        "missed_rows": worker.missed_rows,
        **_stats(missed)[0],
    }
    return result


def salts(path: str) -> dict:
    from vllm import SamplingParams

    llm = make_vllm(path, irminsul=True, connector_extra={"publish_salt": PUBLISH_SALT})
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(1)
    doc, public = _ids(rng, 600), _ids(rng, 600)
    asked = [
        ("a", doc),
        ("b", doc),
        (None, doc),
        ("a", doc),
        (PUBLISH_SALT, public),
        ("a", public),
        ("b", public),
        (None, public),
    ]
    out = []
    for salt, body in asked:  # one at a time: each sees what the ones before it stored
        prompt = {"prompt_token_ids": _ids(rng, 40) + body + _ids(rng, 8)}
        if salt is not None:
            prompt["cache_salt"] = salt
        out.append({"salt": salt, **_stats(llm.generate([prompt], params, use_tqdm=False))[0]})
    return {"requests": out}


def main() -> int:
    torch.set_num_threads(1)
    path, what = sys.argv[1], sys.argv[2]
    result = cycle(path, int(sys.argv[3])) if what == "cycle" else salts(path)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
