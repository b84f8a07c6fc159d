#!/usr/bin/env bash
# The prepared device run of docs/gpu.md: the paper's base model on one GPU, qkv against Hugging Face's
# MarianMTModel on the same batches (float32 with TF32, bf16, bf16 + torch.compile), each of qkv's GPU-side
# choices measured against its absence (benchmarks/gpu_train.py's ablations), and greedy and beam decoding,
# eager against --compile; one JSON. Sections are ordered cheap first and skipped once the budget is spent,
# so it ends within about 6 minutes (the budget, 330 s, plus start-up).
#
#   bash benchmarks/gpu_run.sh [OUT.json]             # on the GPU machine (default: gpu_run.json)
#   bash benchmarks/gpu_run.sh --dry-run [OUT.json]   # the same sections on the CPU at tiny shapes
#                                                     # (tests/test_gpu_bench.py runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
dry=()
if [ "${1:-}" = "--dry-run" ]; then
  dry=(--dry-run)
  shift
fi
out="${1:-gpu_run.json}"
python -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "none"))'
exec python benchmarks/gpu_train.py ${dry[@]+"${dry[@]}"} \
  --settings fp32,bf16,bf16+compile,hf-fp32,hf-bf16,hf-bf16+compile \
  --ablations bf16,tf32,sdpa,fused-adam,sync-free,loss-upcast,fused-loss,compile \
  --steps 10 --warmup 2 --pairs 200000 --decode-engines eager,compile --decode-rounds 3 \
  --budget 330 --json "$out"
