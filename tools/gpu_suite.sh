#!/usr/bin/env bash
# The GPU checks and benchmarks behind docs/benchmarks/, in steps of at most about ten minutes each.
#
#   bash tools/gpu_suite.sh OUT_DIR STEP [STEP ...]
#
# Steps: tests (pytest -m gpu, over 10 min on a fresh machine: tests-k (tests/kernels, ~6 min with a warm Triton
# cache, far longer cold), tests-a (tests/api, ~5 min: every mode's kernels compile, the one-rank ring alone ~2 min)
# and tests-m split it; tests-par runs tests/kernels and tests/api but the multi-process ones in TEST_JOBS (default
# 8) pytest-xdist workers, compile-bound work spread over the cores, then tests-seq the rest one test at a time (the
# VGGT-1B tests hold ~24 GB each: run side by side they run out of memory)), models (bench_models
# --quick), models-graph (the same with CUDA-graph timing on both sides), window-key (bench_window --cuda-graph: Swin-B
# / Swin-v2-B batch 64, every stage, the key case's launch-config sweep, whole models), imagenet (eval_imagenet, random
# weights, 512 synthetic crops of tests/data/photos), recon (per-mode VGGT-1B agreement + timing on
# demos/data/stereo_rig), vggt (bench_vggt 10/50 frames), vggt100 (100 frames fp32 vs SDPA), vggt-agree (VGGT-1B
# mode-vs-SDPA agreement tests), fastvggt (FastVGGT 100/200 frames, every row), fastvggt500, svd (attention at real SVD
# shapes; needs diffusers), pasa (PASA kernel GPU tests + speed sweep), attention (bench_attention, every shape and
# backend), eager (host time per call and eager vs CUDA-graph timing at ViT shapes), models-eager (whole timm models,
# eager), models-compile (ViT-B and Swin-B fp16 under torch.compile default / reduce-overhead, patched vs unpatched),
# cold (first-call cost with an empty Triton cache), train-tests (backward and window-gradient GPU tests), train
# (training steps), window-bwd (the window backward alone at Swin-B's four stage shapes vs SDPA, with a bias-splits
# sweep), bwd-short (the half backward at ViT-B/16 224, ViT-L/14 224 and 64-token heads: the whole-head kernel, the
# default there, beside the two kernels and SDPA), bwd-configs (the dense backward at ViT-B shapes with
# register-spill-free dQ tiles beside the default: check_kernels_offline's spill column), bwd-bias (the half backward
# with a relative-position-bias gradient, D = 64 and 32: the bias-gradient tiles beside the plain ones), bwd-sweep
# (dense backward tile sweep at long sequences: bf16 D = 64 / 128, fp32), train-v2 (training steps of Swin-v2-B 256 px
# and ViT-B/16 at 1024 px), bwd-products (the fp32 / tf32 backward with split-FP16 products, the default, beside
# tl.dot's 3xTF32), fwd-bwd (attention forward + backward vs SDPA), varlen (ragged-batch GPU tests + Table 2),
# stream-k (the stream-K schedule's GPU tests, memcheck over the split-KV and ragged / stream-K cases in bf16 and fp32,
# each run twice so that the direct launches with raw workspace addresses are checked too,
# bench_split_kv in bf16 and in fp32, a run each to stay within a step's time), vggt200 (VGGT-1B at 200 frames,
# bf16 / fp32 vs SDPA, peak beside estimate_memory), vggt-tests (VGGT GPU tests incl.
# training), families (the timm families beyond ViT / Swin, patched vs unpatched), naflex (NaFlexViT padded batch),
# ring1 (the context-parallel ring on one rank vs attention), demo300 (the demo on VIDEO, 300 frames, full-size random
# weights), train-bound / train-bound-1024 / vggt-bound / integrations-bound (the attention-free bounds: training
# steps, VGGT and FastVGGT bf16 at 200 frames, the transformers / diffusers cells; integrations need transformers and
# diffusers installed), fastvggt-official (FastVGGT against the official code at FASTVGGT, a checkout of
# mystorm16/FastVGGT), conformance (the randomized conformance suite: every family and mode against the float64 oracle,
# any layout, ~2000 cases), memcheck / racecheck / initcheck (compute-sanitizer over tools/memcheck_cases.py: a small
# case of every kernel family and variant, forward and backward), racecheck-control (racecheck over the
# warp-specialization control kernels alone: the bare hand-off, data handed through an mbarrier, then a ring slot
# reused over four rounds, with and without TMA bytes in each phase), initcheck-control (initcheck over a tile written
# by plain stores, then by a TMA store: whether initcheck counts TMA stores as initialising), warmup-train
# (python -m visionattn.warmup --training --jobs 16, every mode to the end). Every step logs to OUT_DIR/STEP.log and a
# failing step does not stop the next one. Machine-wide settings are left alone.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR STEP...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the package is imported as installed (editable or not): a bare checkout stops here with the fix
python -c "import visionattn" 2> "$out/import.txt" \
  || { cat "$out/import.txt"; echo "install first: pip install -e . --no-deps"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python - >> "$out/gpu.txt" 2>&1 <<'EOF'
import torch, triton, timm; print("torch", torch.__version__, "triton", triton.__version__, "timm", timm.__version__)
EOF

run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "step $name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}

for step in "$@"; do
  case $step in
    tests) run tests 560 python -m pytest -m gpu -q -rf --timeout=150 -p no:cacheprovider --durations=15 tests ;;
    tests-k) run tests-k 560 python -m pytest -m gpu -q --timeout=250 -p no:cacheprovider tests/kernels ;;
    tests-a) run tests-a 560 python -m pytest -m gpu -q --timeout=250 -p no:cacheprovider tests/api ;;
    tests-m) run tests-m 300 python -m pytest -m gpu -q --timeout=250 -p no:cacheprovider tests/models tests/patching \
        tests/tools ;;
    tests-par) run tests-par 560 python -m pytest -m gpu -q -rfE -n "${TEST_JOBS:-8}" --timeout=250 \
        -p no:cacheprovider tests/kernels tests/api --ignore=tests/api/test_distributed.py \
        --ignore=tests/api/test_distributed_hostile.py --ignore=tests/api/test_ulysses.py
      run tests-seq 560 python -m pytest -m gpu -q -rfE --timeout=250 -p no:cacheprovider tests/models tests/patching \
        tests/tools tests/api/test_distributed.py tests/api/test_distributed_hostile.py tests/api/test_ulysses.py ;;
    models) run models 120 python tools/bench_models.py --quick --out "$out/models_bench" ;;
    models-graph) run models-graph 150 python tools/bench_models.py --quick --cuda-graph \
        --out "$out/models_bench_graph" ;;
    window-key) run window-key 200 python tools/bench_window.py --cuda-graph \
        --models swin_base_224,swinv2_base_w16_256 --batches 64 --no-module --out "$out/window_key" ;;
    vggt-agree) run vggt-agree 250 python -m pytest -m gpu -q -rf --timeout=200 -p no:cacheprovider \
        tests/models/test_vggt_gpu.py ;;
    fastvggt) run fastvggt 300 python tools/bench_vggt.py --models fastvggt --frames 100 200 \
        --out "$out/fastvggt_bench" ;;
    imagenet) run imagenet 300 python tools/eval_imagenet.py --random-weights --synthetic-from tests/data/photos \
        --limit 512 --batch-size 64 --model vit_base_patch16_224 --model deit_small_patch16_224 \
        --model swin_tiny_patch4_window7_224 --model swinv2_tiny_window8_256 --out "$out/imagenet.json" ;;
    recon) run recon 80 python tools/eval_reconstruction.py modes demos/data/stereo_rig --weights random \
        --modes fp32,tf32,fp16,bf16,pasa,sdpa --warmup 1 --out "$out/recon_modes" ;;
    vggt) run vggt 420 python tools/bench_vggt.py --models vggt fastvggt --frames 10 50 --out "$out/vggt_bench" ;;
    vggt100) run vggt100 200 python tools/bench_vggt.py --models vggt --rows sdpa-fp32 fp32 sdpa-bf16 bf16 \
        --frames 100 --out "$out/vggt_bench" ;;
    fastvggt500) run fastvggt500 120 python tools/bench_vggt.py --models fastvggt --rows bf16 --frames 500 \
        --out "$out/vggt_bench" ;;
    svd) run svd 170 python tools/bench_svd_attention.py --bench-levels 2 --bench-reps 5 --out "$out/svd_attention" ;;
    pasa) run pasa-tests 150 python -m pytest -m gpu -q -rf --timeout=120 -p no:cacheprovider \
        tests/kernels/test_pasa_kernel.py
      run pasa 200 python tools/eval_pasa.py --bench-only --out "$out/pasa" ;;
    attention) run attention 300 python tools/bench_attention.py --out "$out/attention" ;;
    eager) run eager 240 python tools/bench_attention.py --shapes "ViT-B/16 224,ViT-B/16 512,L-4k" --no-flex \
        --out "$out/attention_eager" ;;
    models-eager) cases=vit_base_patch16_224:224:64,deit3_small_patch16_224:224:128,eva02_base_patch14_224:224:64
      cases+=,swin_base_patch4_window7_224:224:64,swinv2_base_window8_256:256:64,vit_base_patch16_224:1024:8
      run models-eager 240 python tools/bench_models.py --cases "$cases" \
        --modes fp32,fp16,bf16 --no-share --rep-ms 150 --rounds 4 --out "$out/models_eager" ;;
    cold) run cold 240 python tools/bench_cold_start.py --modes fp16 --mode fp32 --frames 100 --other-frames 60 \
        --out "$out/cold_start" ;;
    models-compile) cases=vit_base_patch16_224:224:64,swin_base_patch4_window7_224:224:64
      run models-compile 280 python tools/bench_models.py --cases "$cases" --modes fp16 --no-share --compile default \
        --out "$out/models_compile_default"
      run models-compile-ro 280 python tools/bench_models.py --cases "$cases" --modes fp16 --no-share \
        --compile reduce-overhead --out "$out/models_compile_ro" ;;
    train-tests) run train-tests 400 python -m pytest -m gpu -q --timeout=200 -p no:cacheprovider \
        tests/kernels/test_elsa_bwd.py tests/kernels/test_window_bwd.py tests/api/test_window_grad.py \
        tests/api/test_op_layer.py ;;
    train) run train 400 python tools/bench_train.py \
        --cases vit_base_patch16_224:224:64,swin_base_patch4_window7_224:224:64 --modes fp32,bf16 --out "$out/train" ;;
    window-bwd) run window-bwd 300 python tools/bench_backward.py --shapes swin-b-s1 swin-b-s2 swin-b-s3 swin-b-s4 \
        swinv2-b-s1 --modes fp32 bf16 --bias-splits 8 32 128 --fp32-products tf32x3 --out "$out/window_bwd" ;;
    bwd-products) run bwd-products 300 python tools/bench_backward.py --shapes long-4k vit-b16-224 vit-b16-224-relpos \
        --modes fp32 tf32 --fp32-products tf32x3 --out "$out/bwd_products" ;;
    bwd-configs) run bwd-configs 400 python tools/bench_backward.py --shapes vit-b16-224 vit-b16-224-relpos \
        --modes fp32 bf16 --configs 32,128,4,3/128,32,8,3 32,64,4,2/128,32,8,3 32,64,4,2/64,32,8,2 \
        32,128,8,2/128,32,8,2 --out "$out/bwd_configs" ;;
    bwd-short) run bwd-short 300 python tools/bench_backward.py --modes bf16 fp16 --shapes vit-b16-224 vit-l14-224 \
        heads-64 --configs 32,128,4,3/128,32,4,3 --out "$out/bwd_short" ;;
    bwd-sweep) run bwd-sweep-half 250 python tools/bench_backward.py --shapes long-4k long-16k vit-b16-224 \
        --modes bf16 --configs 32,128,4,4/128,32,4,4 32,128,4,5/128,32,4,5 64,128,8,3/128,64,8,3 64,128,8,2/128,64,8,2 \
        32,128,8,3/128,32,8,3 64,64,4,3/64,64,4,3 --out "$out/bwd_sweep_half"
      run bwd-sweep-d128 150 python tools/bench_backward.py --shapes long-4k-d128 --modes bf16 --configs \
        32,128,8,3/128,32,8,3 64,64,4,2/64,64,4,2 64,128,8,2/128,64,8,2 32,64,4,3/64,32,4,3 --out "$out/bwd_sweep_d128"
      run bwd-sweep-fp32 250 python tools/bench_backward.py --shapes long-4k vit-b16-224 --modes fp32 --configs \
        64,64,4,2/64,64,4,2 64,128,8,2/128,64,8,2 32,64,4,3/64,32,4,3 64,64,8,2/64,64,8,2 32,128,8,2/128,32,8,2 \
        --out "$out/bwd_sweep_fp32" ;;
    bwd-bias) run bwd-bias 300 python tools/bench_backward.py --shapes vit-b16-224-relpos vit-b16-224-relpos-d32 \
        --modes fp16 bf16 --configs 32,128,4,3/128,32,4,3 32,128,4,3/128,32,8,3 --out "$out/bwd_bias" ;;
    train-v2) run train-v2 400 python tools/bench_train.py \
        --cases swinv2_base_window8_256:256:32,vit_base_patch16_224:1024:8 --modes fp32,bf16 --out "$out/train_v2" ;;
    fwd-bwd) run fwd-bwd 300 python tools/bench_attention.py --backward --no-flex --shapes "L-4k,ViT-B/16 224" \
        --out "$out/attention_fwd_bwd" ;;
    varlen) run varlen-tests 200 python -m pytest -m gpu -q --timeout=150 -p no:cacheprovider tests/api/test_varlen.py
      run varlen 200 python tools/bench_varlen.py --out "$out/varlen" ;;
    stream-k) run stream-k-tests 300 python -m pytest -m gpu -q -rf --timeout=200 -p no:cacheprovider \
        tests/kernels/test_stream_k.py tests/api/test_varlen.py
      run stream-k-memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
        python tools/memcheck_cases.py --families split varlen --modes bf16 fp32 --calls 2
      for mode in bf16 fp32; do
        run "split-kv-$mode" 300 python tools/bench_split_kv.py --modes "$mode" --calls 10 --repeats 5 \
          --out "$out/split_kv_$mode"
      done ;;
    vggt200) run vggt200 420 python tools/bench_vggt.py --models vggt --rows sdpa-bf16 bf16 fp32 --frames 200 \
        --out "$out/vggt200" ;;
    vggt-tests) run vggt-tests 300 python -m pytest -m gpu -q -rf --timeout=250 -p no:cacheprovider \
        tests/models/test_vggt_gpu.py tests/models/test_vggt_train.py ;;
    families) cases=beit_base_patch16_224:224:64,cait_s24_224:224:64,xcit_small_12_p16_224:224:64
      cases+=,coatnet_0_rw_224:224:64,maxvit_tiny_tf_224:224:64,hiera_base_224:224:64,mvitv2_small:224:64
      run families 400 python tools/bench_models.py --modes fp32,fp16 --no-share --out "$out/families" \
        --cases "$cases" ;;
    naflex) run naflex 200 python tools/bench_varlen.py --naflex --modes fp32,bf16 --out "$out/naflex" ;;
    conformance) run conformance 560 python tools/gpu_conformance.py --isolate --time-budget 465 \
        --out "$out/conformance" ;;
    memcheck|racecheck|initcheck) run "$step" 560 compute-sanitizer --tool "$step" --error-exitcode 9 \
        --print-limit 20 python tools/memcheck_cases.py ;;
    racecheck-control) run racecheck-control 120 compute-sanitizer --tool racecheck --print-limit 5 \
        python tools/memcheck_cases.py --control
      run racecheck-control-data 120 compute-sanitizer --tool racecheck --print-limit 5 \
        python tools/memcheck_cases.py --control-data
      for ring in plain tma; do
        run "racecheck-control-ring-$ring" 120 compute-sanitizer --tool racecheck --print-limit 5 \
          python tools/memcheck_cases.py --control-ring "$ring"
      done ;;
    initcheck-control) for how in store tma; do
        run "initcheck-control-$how" 120 compute-sanitizer --tool initcheck --print-limit 5 \
          python tools/memcheck_cases.py --control-init "$how"
      done ;;
    warmup-train) run warmup-train 560 python -m visionattn.warmup --training --jobs 16 ;;
    ring1) run ring1 200 torchrun --nproc-per-node 1 tools/bench_context_parallel.py --out "$out/ring1" ;;
    demo300) run demo300 500 python demos/reconstruct.py "${VIDEO:?set VIDEO to a video of >= 300 frames}" \
        --out "$out/demo300" --weights random --device cuda --max-frames 300 --mode bf16 --no-preview ;;
    train-bound) run train-bound 480 python tools/bench_train.py --attention-free \
        --cases vit_base_patch16_224:224:64,swin_base_patch4_window7_224:224:64,swinv2_base_window8_256:256:32 \
        --modes fp32,bf16 --out "$out/train_bound" ;;
    train-bound-1024) run train-bound-1024 300 python tools/bench_train.py --attention-free \
        --cases vit_base_patch16_224:1024:8 --modes fp32,bf16 --out "$out/train_bound_vit1024" ;;
    vggt-bound) run vggt-bound 300 python tools/bench_vggt.py --models vggt fastvggt --rows sdpa-bf16 bf16 free-bf16 \
        --frames 200 --out "$out/vggt_bound" ;;
    integrations-bound) run integrations-bound 400 python tools/bench_integrations.py --attention-free --rounds 2 \
        --out "$out/integrations_bound" ;;
    fastvggt-official) run fastvggt-official 560 python tools/bench_official.py --model fastvggt \
        --official "${FASTVGGT:?set FASTVGGT to a checkout of the official FastVGGT code}" --frames 100 200 500 \
        --out "$out/fastvggt_official" ;;
    *) echo "unknown step $step" | tee -a "$out/steps.txt" ;;
  esac
done
