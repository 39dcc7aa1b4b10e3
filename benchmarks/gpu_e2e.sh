#!/usr/bin/env bash
# On the GPU box, after benchmarks/gpu_run.sh (kernels): the end-to-end checks of issues 4 and 5.
#   1. an HF Llama training step (hidden 2048, V=128256, 8 x 2048 tokens), backend inductor vs inductor_xent
#   2. the transformers zoo in bf16 on CUDA through the Triton kernels
#   3. the demo on the GPU
#   4. the CUDA kernel tests
# Each step writes its log (and JSON) under $OUT; a step that fails does not stop the next.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
timeout 240 python3 -m inductor_xent bench e2e --out "$OUT" 2>&1 | grep -v "it/s\]" | tee "$OUT/e2e.log" | tail -8
INDUCTOR_XENT_TEST_DEVICE=cuda INDUCTOR_XENT_TEST_DTYPE=bfloat16 timeout 240 \
    python3 -m pytest tests/test_models.py -q -p no:cacheprovider 2>&1 | tee "$OUT/zoo_cuda.log" | tail -6
timeout 150 python3 -m inductor_xent demo 2>&1 | grep -v "it/s\]" | tee "$OUT/demo_gpu.log" | tail -16
timeout 150 python3 -m pytest -m cuda tests/test_gpu_kernels.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log" | tail -4
