#!/usr/bin/env bash
# lm-evaluation-harness, the real client, against a running `irminsul serve`: a multiple-choice task
# (loglikelihood: echo + logprobs on /v1/completions) and a generate_until task (greedy, stop strings),
# both over data.jsonl (20 questions written for this check). It checks the API, not the model: the
# bundled model scores about chance.
#
# lm_eval needs its own environment (torch 2.13.0 first; lm_eval 0.4.9 breaks with transformers 5 and
# with datasets >= 4.1 beside the hub client that transformers 4 brings):
#   python3 -m venv /tmp/lmeval-venv && . /tmp/lmeval-venv/bin/activate
#   pip install torch==2.13.0 && pip install "lm_eval[api]==0.4.9" "transformers<5" "datasets<4.1"
# Then, with a server running (irminsul serve --port 8000):
#   bash benchmarks/lm_eval/run.sh [URL] [MODEL_DIR]     (defaults: http://127.0.0.1:8000, the bundled MLA model)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
url=${1:-http://127.0.0.1:8000}
model_dir=${2:-$here/../../irminsul/bundled/mla}
name=$(python3 -c 'import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1] + "/v1/models"))["data"][0]["id"])' "$url")
tasks=$(mktemp -d)
for t in irm_mc irm_gen; do sed "s#DATA#$here/data.jsonl#" "$here/$t.yaml" > "$tasks/$t.yaml"; done
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model local-completions \
    --model_args "model=$name,base_url=$url/v1/completions,tokenizer_backend=huggingface,tokenizer=$model_dir,num_concurrent=1,max_retries=1,tokenized_requests=True" \
    --tasks irm_mc,irm_gen --include_path "$tasks" --batch_size 1
