"""One vLLM engine (alone, or with Irminsul) under memory pressure, for test_vllm_preemption.py:
`python -m tests.integrations.preempt_driver CKPT alone|irminsul BLOCKS [OUTPUTS.json]` (from the clone's
root) prints one line, RESULT and a JSON object.

Two documents are stored (each behind one header), then six requests come at once, each a document
behind a new header: four run to the end, one is aborted once it has two output tokens, one right after
the first step. The KV cache holds BLOCKS blocks of 16 tokens (`num_gpu_blocks_override`), fewer than
four requests need, so vLLM preempts requests, those with loaded rows among them, and resumes them.
With OUTPUTS.json (another run's "outputs"), the engine also scores those continuations, and its own,
teacher-forced: each token's log-probabilities from one prefill over the prompt and the tokens before it.
"""

import json
import sys

import numpy as np
import torch

from irminsul.integrations.vllm.connector import INSTANCES
from tests.support.moved import make_vllm

KEPT, MAX_TOKENS = 4, 24


def _ids(rng, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


def _score(llm, prompt: list[int], continuation: list[int]) -> list[dict[str, float]]:
    """Each continuation token's top log-probabilities (and its own) after the prompt and the tokens
    before it, from one prefill (prompt_logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt + continuation}], params, use_tqdm=False)[0]
    return [
        {str(t): lp.logprob for t, lp in out.prompt_logprobs[len(prompt) + j].items()} for j in range(len(continuation))
    ]


def run(path: str, mode: str, blocks: int, score: dict | None = None) -> dict:
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted: list[str] = []
    preempt = Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = counting
    llm = make_vllm(path, irminsul=mode == "irminsul", max_model_len=1024, num_gpu_blocks_override=blocks)
    rng = np.random.default_rng(7)
    docs = [_ids(rng, 600) for _ in range(2)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": _ids(rng, 40) + d + _ids(rng, 8)} for d in docs], one, use_tqdm=False)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
    names = [f"keep{i}" for i in range(KEPT)] + ["abort_decoding", "abort_early"]
    prompts = {name: _ids(rng, 70 + i) + docs[i % 2] + _ids(rng, 8) for i, name in enumerate(names)}
    for name in names:
        engine.add_request(name, {"prompt_token_ids": prompts[name]}, params)
    final, steps, aborted = {}, 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
            elif (
                out.request_id == "abort_decoding"
                and len(out.outputs[0].token_ids) >= 2
                and not aborted.get(out.request_id)
            ):
                engine.abort_request([out.request_id])
                aborted[out.request_id] = steps
        steps += 1
        if steps == 1:
            engine.abort_request(["abort_early"])
            aborted["abort_early"] = 0
    result = {
        "preempted": sorted(set(x.split("-")[0] for x in preempted)),
        "preemptions": len(preempted),
        "aborted": sorted(aborted),
        "steps": steps,
        "outputs": {},
    }
    for name in names[:KEPT]:
        out = final[name].outputs[0]
        result["outputs"][name] = {
            "token_ids": list(out.token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs],
        }
    if score is not None:  # vLLM alone, teacher-forced: its log-probabilities of these continuations
        # and its own noise: each kept request decoded again on its own (another batch), both of its
        # continuations scored
        single = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
        result["single"] = {}
        for name in names[:KEPT]:
            out = llm.generate([{"prompt_token_ids": prompts[name]}], single, use_tqdm=False)[0].outputs[0]
            result["single"][name] = {
                "token_ids": list(out.token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs],
            }
        result["scored"] = {}
        for label, outputs in (("self", result["outputs"]), ("single", result["single"]), ("given", score)):
            result["scored"][label] = {
                name: _score(llm, prompts[name], out["token_ids"]) for name, out in outputs.items()
            }
    if mode == "irminsul":
        sched, worker = INSTANCES["scheduler"][-1], INSTANCES["worker"][-1]
        stats = {k.split("-")[0]: vars(v) for k, v in sched.stats.items()}
        result["stats"] = {name: stats.get(name) for name in names}
        result["in_flight"] = sched.in_flight()
        result["worker"] = {
            "loaded_rows": worker.loaded_rows,
            "missed_rows": worker.missed_rows,
            "rows_match_registry": {e.payload for e in sched.index.registry.entries()} == set(worker.rows),
        }
    return result


def main() -> int:
    torch.set_num_threads(1)
    path, mode, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    score = json.loads(open(sys.argv[4]).read()) if len(sys.argv) > 4 else None
    print("RESULT " + json.dumps(run(path, mode, blocks, score)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
