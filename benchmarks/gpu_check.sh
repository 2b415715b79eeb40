#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, in under 10 minutes:
#   1. the triton backend's (attention, MoE, CUDA graphs of decode) and the sampler's tests, on CUDA (compiled
#      kernels, the bf16 tensor-core path, graphs captured and replayed);
#   2. benchmarks/gpu_check.py: random weights in DeepSeek-V2-Lite's shapes (15.7 B parameters, bf16),
#      decode tokens/s at 1 / 32 / 128 concurrent against transformers on the same weights (and the captured
#      decode steps against eager ones), agent_meta
#      TTFT and prefill energy (NVML) for pic against prefix, RoPE-at-read throughput;
#   3. benchmarks/gpu_tiles.py: the attention and MoE kernels' tile sizes, each candidate against the
#      default on the same shapes (the defaults were not chosen on a GPU).
# Needs python3 with torch (CUDA), triton, transformers, tokenizers, safetensors, xxhash, numpy, tqdm and
# nvidia-ml-py (the device tool's nvidia-h200 image has them all). Run from anywhere:
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default runs/gpu-check; $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_attention.py tests/model/test_triton_moe.py \
    tests/model/test_graphs.py tests/engine/test_sampling.py \
    2>&1 | tee "$out/kernel-tests.log" || echo "KERNEL TESTS FAILED (kernel-tests.log); measuring anyway"
python3 benchmarks/gpu_check.py --out "$out" 2>&1 | tee "$out/gpu-check.log" || echo "GPU_CHECK.PY FAILED (gpu-check.log)"
python3 benchmarks/gpu_tiles.py --out "$out" 2>&1 | tee "$out/gpu-tiles.log" || echo "GPU_TILES.PY FAILED (gpu-tiles.log)"
