"""lm-evaluation-harness against `irminsul serve`: a log-likelihood multiple-choice task and a
generate_until task through its `local-completions` model, `--batch_size 4`.

    pip install "lm_eval[api]"              # not a project dependency: it pulls pandas, datasets, ...
    python benchmarks/lm_eval_harness.py    # [--items 32] [--model DIR]

The items are local (no dataset hub): passkey probes built from the project's held-out text, as
the bundled model was trained on. Each item's prompt is the chat-formatted text; the multiple-choice
task offers the true passkey and three others of the same length; the generate_until task asks for
the passkey and matches it exactly. The harness tokenizes with the checkpoint's own tokenizer.json
(`tokenizer_backend=huggingface`), sends four prompts per request (`prompt` as a list of token-id
lists, `echo`, `logprobs`), and sums the continuation's log-probs itself.

The script then checks what the harness computed: every multiple-choice log-likelihood it logged
equals `LLM.score` on the same tokens within 1e-4 (float32 on both sides), and prints the accuracy of
both tasks next to the same numbers computed without the server.
"""

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def machine() -> str:
    return (
        f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, python {platform.python_version()}"
    )


def build_items(model_dir: Path, n: int, seed: int) -> list[dict]:
    from irminsul.model.chat_format import END
    from irminsul.research.train import tasks
    from irminsul.research.train.data import Corpus
    from irminsul.research.train.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    corpus = Corpus.load(None)
    held = tasks.TokenPool(tok, corpus.held_out, corpus.tools_held_out, corpus.words)
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        ex = tasks.passkey(held, rng, 320, n_digits=5)
        value = tok.decode(ex.answer_ids[: ex.answer_len]).strip()
        others = set()
        while len(others) < 3:
            o = tasks._digits(rng, len(value))
            if o != value:
                others.add(o)
        choices = [value, *sorted(others)]
        order = rng.permutation(4)
        items.append(
            {
                "id": i,
                "prompt": tok.decode(ex.prompt_ids, skip_special_tokens=False),
                "choices": [" " + choices[j] for j in order],
                "answer": int(np.argmax(order == 0)),
                "value": " " + value,
                "end": END,
            }
        )
    return items


TASKS = """\
task: irminsul_passkey_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
---
task: irminsul_passkey_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
target_delimiter: ""
doc_to_target: value
generation_kwargs:
  until: ["{end}"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not come up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled MLA model)")
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    if shutil.which("lm_eval", path=str(Path(sys.executable).parent)) is None:
        print('lm_eval is not installed: pip install "lm_eval[api]"', file=sys.stderr)
        return 2

    from irminsul.bundled import bundled_model

    model_dir = Path(args.model or bundled_model("mla"))
    print(f"machine: {machine()}\nmodel: {model_dir}")
    work = Path(tempfile.mkdtemp(prefix="irminsul-lm-eval-"))
    items = build_items(model_dir, args.items, args.seed)
    data = work / "passkey.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    (work / "tasks").mkdir()
    for i, block in enumerate(TASKS.format(data=data, end=items[0]["end"]).split("---\n")):
        (work / "tasks" / f"task{i}.yaml").write_text(block)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    irminsul = Path(sys.executable).with_name("irminsul")
    server = subprocess.Popen(
        [str(irminsul), "serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", "tiny"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, server)
        cmd = [
            str(Path(sys.executable).with_name("lm_eval")),
            "--model",
            "local-completions",
            "--model_args",
            f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={model_dir},"
            "num_concurrent=1,max_retries=1,tokenized_requests=True",
            "--tasks",
            "irminsul_passkey_mc,irminsul_passkey_gen",
            "--include_path",
            str(work / "tasks"),
            "--batch_size",
            "4",
            "--output_path",
            str(work / "out"),
            "--log_samples",
        ]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.time()
        run = subprocess.run(
            cmd, env={**env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True
        )
        print(f"lm_eval exited {run.returncode} after {time.time() - t0:.0f} s")
        table = [line for line in run.stdout.splitlines() if line.startswith("|")]
        print("\n".join(table) if table else run.stdout[-3000:] + run.stderr[-3000:])
        if run.returncode != 0:
            return 1
    finally:
        server.terminate()
        server.wait(30)

    return check(model_dir, work / "out", items)


def check(model_dir: Path, out: Path, items: list[dict]) -> int:
    """The harness's log-likelihoods against LLM.score, and both tasks' accuracy without the server."""
    import torch
    from transformers import AutoTokenizer

    from irminsul import LLM

    torch.set_num_threads(1)
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = "mc" if "_mc_" in f.name else "gen"
        samples[task] = [json.loads(line) for line in f.read_text().splitlines()]
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    llm = LLM(model=model_dir, reuse="off", dtype="float32")

    worst, right_mc = 0.0, 0
    for s in samples["mc"]:
        doc = s["doc"]
        lls = []
        for arg, resp in zip(s["arguments"].values(), s["resps"]):  # one (context, continuation) per choice
            context, continuation = arg["arg_0"], arg["arg_1"]
            whole = hf(context + continuation, add_special_tokens=False)["input_ids"]
            ctx = hf(context, add_special_tokens=False)["input_ids"]
            cont = whole[len(ctx) :]
            lp = llm.score(whole[: len(ctx)], cont)
            ll = float(lp[torch.arange(len(cont)), torch.tensor(cont)].sum())
            worst = max(worst, abs(ll - float(resp[0][0])))
            lls.append(ll)
        right_mc += int(np.argmax(lls) == doc["answer"])
    right_gen = 0
    for s in samples["gen"]:
        doc = s["doc"]
        ids = hf(s["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False)["input_ids"]
        text = llm.generate(ids, max_tokens=12, stop=[doc["end"]]).text
        right_gen += int(text == doc["value"])
        assert text == s["resps"][0][0], (text, s["resps"][0][0])
    n_mc, n_gen = len(samples["mc"]), len(samples["gen"])
    print(f"multiple choice: {n_mc} items x 4 choices; max |harness log-likelihood - LLM.score| = {worst:.2e}")
    print(
        f"without the server: acc {right_mc / n_mc:.3f} (multiple choice), exact match {right_gen / n_gen:.3f} "
        f"(generate_until; every generation identical to the harness's)"
    )
    ok = worst < 1e-4
    print("harness log-likelihoods equal LLM.score within 1e-4: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
