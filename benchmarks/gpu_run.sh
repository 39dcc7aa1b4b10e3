#!/usr/bin/env bash
# On the GPU box: the CUDA tests, then the kernel benchmark; JSON/PNG/logs land in $OUT.
#   benchmarks/gpu_run.sh [full|quick|sweep|tests] [extra args for bench_kernels.py]
# Peers (liger-kernel, cut-cross-entropy) come from wheels in .whl/ (git-ignored: name ".whl" in the
# device tool's carry, or they never reach the box and the peers' rows say ModuleNotFoundError).
set -uo pipefail
MODE=${1:-full}; shift || true
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # pure-Python wheels: unzip (the box's venv may lack pip)
    python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('.whl/*.whl')]" \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

if [[ $MODE == full || $MODE == quick || $MODE == tests ]]; then
    python3 -m pytest -m cuda tests/test_gpu_kernels.py -q -p no:cacheprovider --timeout 300 2>&1 | tee "$OUT/pytest_cuda.log"
fi
case $MODE in
    full)  python3 benchmarks/bench_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" ;;
    quick) python3 benchmarks/bench_kernels.py --quick --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" ;;
    sweep) python3 benchmarks/bench_kernels.py --sweep --quick --out "$OUT" "$@" 2>&1 | tee "$OUT/sweep.log" ;;
esac
