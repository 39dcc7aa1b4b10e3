#!/usr/bin/env bash
# One GPU call for what must run on the H200 after the kernels' own benchmark (gpu_run.sh):
#   1. the CUDA kernel tests (tests/test_gpu_kernels.py)
#   2. an HF Llama training step (hidden 2048, V=128256, 8 x 2048 tokens), backend inductor vs inductor_xent
#   3. the transformers zoo in bf16 on CUDA through the Triton kernels (tests/test_models.py)
#   4. a quick kernel benchmark of ours against torch.compile at the llama3-8b shape
# Each step writes its log (and JSON) under $OUT; a step that fails or times out does not stop the next.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
timeout 110 python3 -m pytest -m cuda tests/test_gpu_kernels.py -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_cuda.log" | tail -4
timeout 200 python3 -m inductor_xent bench e2e --warmup 2 --steps 8 --out "$OUT" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/e2e.log" | tail -7
INDUCTOR_XENT_TEST_DEVICE=cuda INDUCTOR_XENT_TEST_DTYPE=bfloat16 timeout 170 \
    python3 -m pytest tests/test_models.py -v -p no:cacheprovider 2>&1 | tee "$OUT/zoo_cuda.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -40
timeout 70 python3 benchmarks/bench_kernels.py --quick --shapes llama3-8b --data gauss --methods compile,ours \
    --out "$OUT" 2>&1 | tee "$OUT/bench_quick.log" | tail -6
