#!/usr/bin/env bash
# Everything that needs the GPU box, in as few device calls as possible. Steps (comma-separated):
#   tests   the README's test command, the whole suite (python3 -m pytest -q), CUDA tests included
#   gputests  only the files whose tests run kernels on the GPU (when a call has little time; GPUTESTS_FILES,
#           GPUTESTS_S override)
#   dynamotests  only the files whose tests depend on how Dynamo traces (zoo subset, models, backend, explain)
#   store   the store strategy's weight-gradient accumulation options (bench kernels --store-options)
#   quick   bench kernels, gauss, the main methods and Liger, all three shapes
#   full    bench kernels, gauss and zipf, every method
#   final   the issue's table in one run: every peer (the CuTe-DSL ones when installed) and strategy,
#           llama3-8b on gauss and zipf, gemma2-2b and gpt2 on gauss
#   llama   bench kernels at llama3-8b, gauss: cuBLAS, torch.compile and ours (LLAMA_METHODS overrides)
#   gemma   bench kernels at gemma2-2b, gauss: cuBLAS, torch.compile, ours (auto) and recompute
#   rounds  fwd+bwd of compile, cuBLAS, ours (auto) and ours through the backend, interleaved over 5
#           rounds at llama3-8b and gemma2-2b (medians and per-round ratios to compile; ROUND_METHODS
#           overrides, e.g. compile,cublas,ours,liger_cute,quack)
#   n16k    compile and ours (auto) at N = 16384 rows, llama3-8b's and gemma2-2b's D and V (memory target;
#           N16K_METHODS overrides)
#   storepair  the store op with its tile and the forward's, twice each, alternating (bench --store-sweep)
#   sweep   kernel config sweep (TMA and tile configs) at the llama3-8b shape
#   e2e     HF Llama training step, backend inductor vs inductor_xent (bench e2e)
#   e2e_modes  the same step under autocast (fp32 parameters), as a whole-model compile (bf16), and both
#           (bench e2e --modes autocast,whole,whole_autocast: issue 23's variants)
#   ignored fwd+bwd at llama3-8b with 0/30/50/70 % ignored rows, prompt spans and scattered padding, 3
#           interleaved rounds: compile, ours, ours with skipping off (ours_dense) and Liger (IGNORED_METHODS,
#           IGNORED_FRACS, IGNORED_LAYOUT, IGNORED_ROUNDS override)
#   e2e_sft the HF Llama step with half of each sequence a prompt (bench e2e --prompt 0.5)
#   distill Hinton KD between a student and a teacher lm_head, every method (bench_distill.py; DISTILL_METHODS,
#           DISTILL_ROUNDS: then the methods' fwd+bwd interleaved over that many rounds; DISTILL_PROMPT=F: F of
#           each sequence ignored, GKD-style, e.g. DISTILL_METHODS=compile,ours,ours_dense; DISTILL_SOFTCAP=C: both
#           heads capped at C, Gemma 2's 30)
#   topk    the top-k head (k = 64, log-probs at T = 0.7) and the kept-set log-probs at llama3-8b against cuBLAS's
#           logits GEMM, eager and torch.compile (bench_topk.py; TOPK_METHODS overrides; TOPK_ROUNDS: then the forwards
#           of cuBLAS and ours interleaved over that many rounds; TOPK_LOGIT_STD: the logits' spread, e.g. 4 for an
#           LLM's kept sets of tens of columns with TOPK_METHODS=cublas,nucleus_ours,nucleus_compile)
#   mtp     multi-token prediction through one lm_head at llama3-8b, main head + 1 depth (bench_mtp.py):
#           compile, the pass's one shared op, one op per site, cuBLAS (MTP_DEPTHS, MTP_ROUNDS override)
#   bicost  INDUCTOR_XENT_BATCH_INVARIANT=1 against off at the qwen2.5-7b RL head, forward and step, 3 rounds
#           (bench_batch_invariant.py), and 300 rows alone against inside the batch
#   probe   scratch/bi_probe.py (or $PROBE) when present (an uncommitted experiment; carry "scratch")
#   rl      the RL head (log-probs + entropy at T = 0.7) at the qwen2.5-7b shape, every method (bench rl;
#           RL_METHODS overrides, e.g. cublas,ours,ours_recompute,compile; RL_PROMPT=F: F of each sequence a
#           prompt without gradient, ignore_index for the API methods, e.g. RL_METHODS=compile,ours,ours_dense;
#           ours_masked: the pass on the spelling masked after the head, its masked rows skipped)
#   profile kernel time per method (torch.profiler) at llama3-8b: compile, store and store through the backend, and the GPU's
#           idle gaps
#   storek  the store strategy's dz pass and split combine alone, per launch parameters (llama3-8b, gemma2-2b)
#   storesweep  the store op per forward tile config at llama3-8b and gemma2-2b (bench --store-sweep)
#   storefwd  the store forward alone per config, interleaved over 5 rounds (STORE_CONFIGS overrides the list)
#   fwdk    the recompute forward alone per config and cuBLAS's GEMM, interleaved over 5 rounds (FWD_CONFIGS)
#   bwdk    the recompute backward, persistent dlogits kernel against one program per tile (4 rounds)
#   zoo     the transformers zoo in bf16 on CUDA (tests/test_models.py)
#   benchmarks/gpu_run.sh tests,store,quick
# Peers and expecttest come as wheels in .whl/ (git-ignored: name ".whl" in the device tool's carry);
# the CuTe-DSL peers' wheels in parts in .cute/ over two calls (below).
# Each step writes its log (and JSON/PNG) under $OUT and has its own timeout; a failing step does
# not stop the next.
set -uo pipefail
STEPS=${1:-tests}
BUDGET=${BUDGET:-560}  # seconds for all steps (a device call may last 600): each step's timeout is cut to fit
FINAL=${OUT:-out}  # what comes back: all.tgz (every log, JSON and PNG) and a few files to look at at once
OUT=$FINAL/raw; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# as the README installs it (the entry point registers the backend); the source tree if that fails
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then  # pure-Python wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
# The CuTe-DSL peers (bench_kernels.CUTE_PEERS) need nvidia-cutlass-dsl 4.8.1, whose libs wheel (92 MB) is
# over one call's 64 MiB carry: its parts travel in .cute/ (git-ignored) over two calls sent back to back
# while the machine is warm (README, "Benchmarks"); each call keeps its parts in /tmp/cute-wheels. Once
# every file in .cute/MANIFEST (sha256sum's format) is whole, all are installed in a folder named
# site-packages: QuACK fingerprints the functions its epilogues use, all but those under a site-packages
# path, and fails on cutlass's internals otherwise.
CUTE_WHEELS=/tmp/cute-wheels CUTE_SITE=/tmp/cute/site-packages
if [ -d .cute ]; then mkdir -p $CUTE_WHEELS && cp .cute/* $CUTE_WHEELS/; fi
if [ -f $CUTE_WHEELS/MANIFEST ] && [ ! -d $CUTE_SITE/quack ]; then
    ( cd $CUTE_WHEELS && for w in $(awk '{print $2}' MANIFEST); do
          if ls "$w".part* >/dev/null 2>&1; then cat "$w".part* > "$w"; fi; done
      sha256sum -c --quiet MANIFEST ) \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target $CUTE_SITE \
               $(awk '{print "'$CUTE_WHEELS'/"$2}' $CUTE_WHEELS/MANIFEST) \
        && echo "CuTe-DSL peers installed" || echo "CuTe-DSL wheels not all here yet (kept in $CUTE_WHEELS)"
fi
if [ -d $CUTE_SITE/nvidia_cutlass_dsl ]; then  # a --target folder's .pth is not read: its path by hand
    export PYTHONPATH=$CUTE_SITE/nvidia_cutlass_dsl/dsl_packages:$CUTE_SITE${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"; date -u; } 2>&1 | tee "$OUT/versions.txt"
BENCH="python3 benchmarks/bench_kernels.py --out $OUT"
CUTE=liger_cute,liger_cute_scaled,quack
TESTS=$(sed -n "s/^\(python3 -m pytest .*\)$/\1/p" README.md | head -n 1)  # the README's own command
left() { echo $(( BUDGET - SECONDS )); }
cap() { local t=$1; local l; l=$(( $(left) - 15 )); [ "$l" -lt "$t" ] && t=$l; echo "$t"; }
timeout() { local t; t=$(cap "$1"); shift; if [ "$t" -lt 20 ]; then echo "(skipped: no time left)"; return 124; fi
            command timeout "$t" "$@"; }
for step in ${STEPS//,/ }; do
    echo "=== $step $(date -u +%T) ($(left) s left)"
    case $step in
        # -v -v (after the README's -q): every test's outcome as it ends, so that a step cut by its timeout
        # still names what failed (the fifth session's last suite run died unnamed at 1021 of 1029)
        tests) echo "+ $TESTS"; timeout ${TESTS_S:-540} $TESTS -v -v -p no:cacheprovider --tb=short --durations=12 2>&1 \
                   | tee "$OUT/pytest.log" | grep -E "FAILED|ERROR|passed|failed|^=" | tail -60 ;;
        gputests) timeout ${GPUTESTS_S:-200} python3 -m pytest -v -n 8 -p no:cacheprovider --tb=short \
                   ${GPUTESTS_FILES:-tests/test_gpu_kernels.py tests/test_templates.py} 2>&1 | tee "$OUT/pytest_gpu.log" \
                   | grep -vE "^\.|^\s*$" | tail -30 ;;
        dynamotests) timeout 250 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short tests/test_zoo.py \
                   tests/test_models.py tests/test_backend.py tests/test_explain.py 2>&1 | tee "$OUT/pytest_dynamo.log" \
                   | grep -vE "^\.|^\s*$" | tail -30 ;;
        store) timeout 150 $BENCH --store-options --quick --shapes llama3-8b 2>&1 | tee "$OUT/store.log" | grep -v "^{" ;;
        quick) timeout 240 $BENCH --quick --data gauss \
                   --methods cublas,compile,liger,ours,ours_recompute,ours_store,ours_compiled 2>&1 \
                   | tee "$OUT/bench.log" | grep -E "^\||error" ;;
        full)  timeout 540 $BENCH 2>&1 | tee "$OUT/bench.log" | grep -E "^\||error" ;;
        final) # the issue's table in one run: peers, every strategy, llama3-8b on both data sets
               mkdir -p "$OUT/llama" "$OUT/others"
               timeout 300 $BENCH --quick --shapes llama3-8b --out "$OUT/llama" \
                   --methods cublas,compile,liger,$CUTE,cce,ours,ours_recompute,ours_store,ours_compiled 2>&1 \
                   | tee "$OUT/bench_llama.log" | grep -E "^\||error"
               timeout 240 $BENCH --quick --shapes gemma2-2b,gpt2 --data gauss --out "$OUT/others" \
                   --methods cublas,compile,liger,$CUTE,ours,ours_recompute,ours_store,ours_compiled 2>&1 \
                   | tee "$OUT/bench_others.log" | grep -E "^\||error" ;;
        llama) timeout 220 $BENCH --quick --shapes llama3-8b --data gauss \
                   --methods ${LLAMA_METHODS:-cublas,compile,ours,ours_recompute,ours_compiled} 2>&1 | tee "$OUT/bench.log" | grep -E "^\||error" ;;
        gemma) timeout 150 $BENCH --quick --shapes gemma2-2b --data gauss \
                   --methods cublas,compile,ours,ours_recompute 2>&1 | tee "$OUT/bench_gemma.log" | grep -E "^\||error" ;;
        rounds) timeout 400 $BENCH --rounds 5 --quick --shapes llama3-8b,gemma2-2b \
                   --methods ${ROUND_METHODS:-compile,cublas,ours,ours_compiled} 2>&1 | tee "$OUT/rounds.log" | grep -E "^\||rror" ;;
        n16k)  timeout 200 $BENCH --quick --shapes 16384x4096x128256,16384x2304x256000 --data gauss \
                   --methods ${N16K_METHODS:-compile,ours} --out "$OUT/n16k" 2>&1 | tee "$OUT/n16k.log" | grep -E "^\||rror" ;;
        storepair) timeout 120 $BENCH --store-sweep --quick --shapes llama3-8b,gemma2-2b \
                   --configs m256n128k64w8s3tma,m128n256k64w8s4tma,m256n128k64w8s3tma,m128n256k64w8s4tma 2>&1 \
                   | tee "$OUT/storepair.log" | grep -E "^\{|rror" ;;
        sweep) timeout 200 $BENCH --sweep --quick --shapes llama3-8b \
                   --configs m128n256k64w8s3,m128n256k64w8s4,m128n256k64w8s3tma,m128n256k64w8s4tma,m256n128k64w8s3tma 2>&1 \
                   | tee "$OUT/sweep.log" | grep -vE "^\s*$" | tail -30 ;;
        e2e)   timeout 230 python3 -m inductor_xent bench e2e --warmup 2 --steps 6 --out "$OUT" 2>&1 \
                   | grep -v "it/s\]" | tee "$OUT/e2e.log" | tail -8 ;;
        ignored) timeout ${IGNORED_S:-300} $BENCH --rounds ${IGNORED_ROUNDS:-3} --quick --shapes llama3-8b \
                   --ignored ${IGNORED_FRACS:-0,0.3,0.5,0.7} --ignored-layout ${IGNORED_LAYOUT:-prompt,padding} \
                   --methods ${IGNORED_METHODS:-compile,ours,ours_dense,liger} 2>&1 | tee "$OUT/ignored.log" | grep -E "^\||^ignored|rror" ;;
        e2e_sft) timeout ${E2E_SFT_S:-230} python3 -m inductor_xent bench e2e --warmup 2 --steps 6 --prompt 0.5 --out "$OUT/sft" 2>&1 \
                   | grep -v "it/s\]" | tee "$OUT/e2e_sft.log" | tail -8 ;;
        e2e_modes) timeout ${E2E_MODES_S:-420} python3 -m inductor_xent bench e2e --warmup 2 --steps 6 --modes autocast,whole,whole_autocast \
                   --out "$OUT/modes" 2>&1 | grep -v "it/s\]" | tee "$OUT/e2e_modes.log" | tail -16 ;;
        distill) timeout ${DISTILL_S:-300} python3 benchmarks/bench_distill.py --quick --rounds ${DISTILL_ROUNDS:-0} \
                   ${DISTILL_METHODS:+--methods $DISTILL_METHODS} ${DISTILL_PROMPT:+--prompt $DISTILL_PROMPT} ${DISTILL_SOFTCAP:+--softcap $DISTILL_SOFTCAP} --out "$OUT" 2>&1 \
                   | tee "$OUT/distill.log" | grep -E "^\||^distill|rror" ;;
        topk)  timeout ${TOPK_S:-150} python3 benchmarks/bench_topk.py --quick --rounds ${TOPK_ROUNDS:-0} ${TOPK_METHODS:+--methods $TOPK_METHODS} \
                   ${TOPK_LOGIT_STD:+--logit-std $TOPK_LOGIT_STD} --out "$OUT" 2>&1 | tee "$OUT/topk.log" | grep -E "^\||^target|^kept|rror" ;;
        mtp)   timeout ${MTP_S:-200} python3 benchmarks/bench_mtp.py --quick --depths ${MTP_DEPTHS:-1} --rounds ${MTP_ROUNDS:-3} \
                   --out "$OUT" 2>&1 | tee "$OUT/mtp.log" | grep -E "^\||^mtp|rror" ;;
        probe) timeout ${PROBE_S:-120} python3 ${PROBE:-scratch/bi_probe.py} 2>&1 | tee "$OUT/probe.log" | tail -60 ;;
        bicost) timeout ${BICOST_S:-150} python3 benchmarks/bench_batch_invariant.py --out "$OUT" 2>&1 \
                   | tee "$OUT/bicost.log" | tail -4 ;;
        rl)    timeout ${RL_S:-150} python3 benchmarks/bench_rl.py --quick --shapes qwen2.5-7b ${RL_METHODS:+--methods $RL_METHODS} ${RL_PROMPT:+--prompt $RL_PROMPT} --out "$OUT" 2>&1 \
                   | tee "$OUT/rl.log" | grep -E "^\||^target|Error|error:" ;;
        profile) timeout 150 $BENCH --profile --shapes llama3-8b --methods compile,ours_store,ours_compiled 2>&1 \
                   | tee "$OUT/profile.log" | grep -vE "^\s*$|^-" | cut -c1-150 | tail -70 ;;
        storek) timeout 90 $BENCH --store-kernels --shapes llama3-8b,gemma2-2b 2>&1 | tee "$OUT/storek.log" \
                   | grep -E "^\{|rror" ;;
        storesweep) timeout 240 $BENCH --store-sweep --quick --shapes llama3-8b,gemma2-2b \
                   --configs m128n256k64w8s4tma,m128n256k64w8s3tma,m256n128k64w8s3tma,m128n128k64w8s4tma,m128n128k64w4s4tma,m128n128k64w8s3tma,m128n256k64w8s4 \
                   2>&1 | tee "$OUT/storesweep.log" | grep -E "^\{|rror" ;;
        storefwd) timeout 200 $BENCH --store-forward --rounds 5 --shapes llama3-8b,gemma2-2b \
                   --configs ${STORE_CONFIGS:-m128n256k64w8s3tma,m128n256k64w8s4tma,m256n128k64w8s3tma} \
                   2>&1 | tee "$OUT/storefwd.log" | grep -E "^\{|rror" | cut -c1-220 ;;
        fwdk)  timeout 200 $BENCH --forward --rounds 5 --shapes llama3-8b,gemma2-2b \
                   ${FWD_CONFIGS:+--configs $FWD_CONFIGS} \
                   2>&1 | tee "$OUT/fwdk.log" | grep -E "^\{|rror" | cut -c1-200 ;;
        bwdk)  timeout 200 $BENCH --backward --rounds 4 --shapes llama3-8b,gemma2-2b \
                   2>&1 | tee "$OUT/bwdk.log" | grep -E "^\{|rror" | cut -c1-200 ;;
        zoo)   INDUCTOR_XENT_TEST_DEVICE=cuda INDUCTOR_XENT_TEST_DTYPE=bfloat16 timeout 200 \
                   python3 -m pytest tests/test_models.py -q -p no:cacheprovider 2>&1 | tee "$OUT/zoo_cuda.log" | tail -5 ;;
        *) echo "unknown step $step" ;;
    esac
done
echo "=== done $(date -u +%T)"
tar -czf "$FINAL/all.tgz" -C "$FINAL" raw
for f in pytest.log pytest_gpu.log pytest_dynamo.log llama/bench_pareto.png llama/bench_kernels.json others/bench_kernels.json bench_e2e.json \
         distill.log bench_distill.json rl.log bench_rl.json bench_rl.png profile.log rounds.log n16k.log storek.log storesweep.log storepair.log storefwd.log fwdk.log bwdk.log bench_gemma.log bench.log e2e.log \
         e2e_modes.log modes/bench_e2e.json ignored.log e2e_sft.log sft/bench_e2e.json; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "$FINAL/$(echo "$f" | tr / _)"
done
rm -rf "$OUT"
