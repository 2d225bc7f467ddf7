#!/usr/bin/env bash
# One device run: install the carried wheels, then run the named steps, each under its own timeout,
# writing logs and JSON into $OUT. Usage: bash scripts/gpu_session.sh STEP [STEP ...]
# The device image lacks some of the project's packages: fill .whl/ first (and carry it), with every one of them
# (session 58's first run had only the tool's default two: the beam and guided GPU tests failed on imports):
#   ../shared/tools/device-wheels structlog pytest-asyncio pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions pytest-timeout
# and llguidance (>=1.7, pyproject's floor: its wheels are manylinux_2_31, which that tool's platforms leave out):
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 -d .whl "llguidance>=1.7"
set -u
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="/tmp/site:$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; \
         echo "rc=$?"; tail -n 60 "$OUT/$name.log"; }
for s in "$@"; do
  case $s in
    info) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; df -h . | tail -1 ;;
    tests) step tests 360 python3 -m pytest -q -p no:cacheprovider -m gpu $(grep -l "mark\.gpu" tests/test_*.py) ;;  # every gpu-marked test, wherever it lives
    # compute-sanitizer memcheck over the transfer and copy-kernel tests, torch's caching allocator off so that an access
    # past a tensor is past an allocation (the errors, if any, in memcheck.txt; its last line counts them; the refused
    # runtime calls test_gpu_cover_s73 makes on purpose show there as API errors: cudaErrorInvalidPitchValue, 712)
    # (the CUDA-graph cases deselected: without the caching allocator a capture's cudaMalloc is refused, and the
    # failed capture broke the RNG for every later test: session 74's run, 9 such failures, no memory error)
    memcheck) MEMCHECK_DESELECT=$(printf -- '--deselect tests/test_gpu_transfers.py::test_layer_flags_hold_each_layer_until_its_copy_landed[True-%s] ' False-0 True-0 False-112)
              PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck 500 compute-sanitizer --tool memcheck --print-limit 40 \
                --log-file "$OUT/memcheck.txt" python3 -m pytest -q -p no:cacheprovider -m gpu --tb=line \
                tests/test_gpu_cover_s73.py tests/test_gpu_transfers.py $MEMCHECK_DESELECT; tail -n 3 "$OUT/memcheck.txt" ;;
    tests_sampling) step tests_sampling 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_sampling.py ;;
    kernels) step kernels 200 python3 scripts/bench_kernels.py --out "$OUT/kernels.json" ;;
    transfer) step transfer 200 python3 scripts/bench_transfer.py --out "$OUT/transfer.json" ;;
    transfer_direct) for i in 1 2; do step "transfer_direct$i" 200 python3 scripts/bench_transfer.py --backends triton --layouts consecutive --direct-pages 0,7,14,0,7,14 --tokens 1000,3504 --directions-only --out "$OUT/transfer_direct$i.json"; done ;;
    transfer2) step transfer2 200 python3 scripts/bench_transfer.py --out "$OUT/transfer2.json" ;;
    engine_guided) step engine_guided 400 python3 scripts/bench_engine.py --model qwen3-8b --skip-eager --prefill-tokens 350 --decode-batches 1,32 --guided-decode 32,512,128 --out "$OUT/engine_guided.json" ;;
    engine_guided_bpe) [ -f .whl/bpe151k/tokenizer.json ] || python3 scripts/make_bpe_tokenizer.py --out .whl/bpe151k  # (carried, or built: ~30 s)
              step guided_masks 200 python3 scripts/probe_guided_masks.py --tokenizer .whl/bpe151k --rows 1,8,32 --json
              for g in text json json_free; do step "engine_guided_bpe_$g" 400 python3 scripts/bench_engine.py --model qwen3-8b --skip-eager --prefill-tokens 350 --decode-batches 1 --guided-decode 32,512,128 --guided-grammar $g --guided-tokenizer .whl/bpe151k --out "$OUT/engine_guided_bpe_$g.json"; done ;;
    engine_bans) step engine_bans 300 python3 scripts/bench_engine.py --model qwen3-8b --skip-eager --prefill-tokens 350 --decode-batches 1 --banned-decode 32,512,128 --out "$OUT/engine_bans.json" ;;
    restart) step restart 300 python3 scripts/bench_restart.py --json --out "$OUT/restart.json" ;;
    restart_cold) step restart_cold 300 python3 scripts/bench_restart.py --storage-cache cold --json --out "$OUT/restart_cold.json" ;;
    preemption) step preemption 300 python3 scripts/bench_preemption.py --ratios 1,0.3,0.1,0,auto --json --out "$OUT/preemption.json"
              step preemption_l2 300 python3 scripts/bench_preemption.py --l2 --l1-tokens 32768 --ratios 1,0,auto --json --out "$OUT/preemption_l2.json" ;;
    shared_prefill) step shared_prefill 300 python3 scripts/bench_shared_prefill.py --json --out "$OUT/shared_prefill.json" ;;
    speculative) step speculative 400 python3 scripts/bench_speculative.py --json --out "$OUT/speculative.json" ;;
    beam) step beam 400 python3 scripts/bench_beam_search.py --repeats 2 --json --out "$OUT/beam.json" ;;
    engine) step engine 300 python3 scripts/bench_engine.py --model qwen3-8b --profile --skip-eager --out "$OUT/engine.json" ;;
    latency_l2) step latency_l2 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 350,1000,2000,3500,8000 --compare-recompute --json --out "$OUT/latency_l2.json" ;;
    latency_noovl) step latency_noovl 240 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 350,1000,3500 --disable-restore-overlap --json --out "$OUT/latency_noovl.json" ;;
    latency_eager) step latency_eager 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 350,1000,3500,8000 --compare-recompute --disable-cuda-graphs --json --out "$OUT/latency_eager.json" ;;
    latency_l3) step latency_l3 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l3 --prefix-tokens 1000,3500,8000 --storage-cache cold --io-workers 8 --json --out "$OUT/latency_l3.json" ;;
    latency_l3w) step latency_l3w 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l3 --prefix-tokens 1000,3500,8000 --storage-cache warm --io-workers 8 --json --out "$OUT/latency_l3w.json" ;;
    latency_l3_all) step latency_l3_all 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l3 --prefix-tokens 350,1000,2000,3500,8000 --storage-cache cold --io-workers 8 --json --out "$OUT/latency_l3_all.json" ;;
    latency_l3w_all) step latency_l3w_all 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l3 --prefix-tokens 350,1000,2000,3500,8000 --storage-cache warm --io-workers 8 --json --out "$OUT/latency_l3w_all.json" ;;
    latency_l3_4b) step latency_l3_4b 300 python3 scripts/bench_hicache.py --model qwen3-4b --tier l3 --prefix-tokens 350,1000,2000,3500,8000 --storage-cache cold --io-workers 8 --json --out "$OUT/latency_l3_4b.json" ;;
    latency_l3w_4b) step latency_l3w_4b 300 python3 scripts/bench_hicache.py --model qwen3-4b --tier l3 --prefix-tokens 350,1000,2000,3500,8000 --storage-cache warm --io-workers 8 --json --out "$OUT/latency_l3w_4b.json" ;;
    latency_4b) step latency_4b 300 python3 scripts/bench_hicache.py --model qwen3-4b --tier l2 --prefix-tokens 350,1000,2000,3500,8000 --compare-recompute --json --out "$OUT/latency_4b.json" ;;
    stress) step stress 400 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2,l2small,l3 --policy cost --decode-batch 32 --decode-tokens 64 --json --out "$OUT/stress.json" ;;
    latency_whole_ab) i=0; for v in "" "--disable-whole-first" "" "--disable-whole-first"; do i=$((i+1))
              step "latency_whole_ab$i" 200 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 1000,3500,8000 $v --json --out "$OUT/latency_whole_ab$i.json"; done ;;
    latency_1000) step latency_1000 200 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 1000,3500 --iterations 12 --json --out "$OUT/latency_1000.json" ;;
    latency_l3w_nock) step latency_l3w_nock 200 python3 scripts/bench_hicache.py --model qwen3-8b --tier l3 --prefix-tokens 1000,3500,8000 --storage-cache warm --io-workers 8 --disable-checksum --json --out "$OUT/latency_l3w_nock.json" ;;
    bisect) for v in "" "--disable-cuda-graphs" "--transfer-backend torch" "--page-size 1"; do
              step "bisect${v// /_}" 200 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 1000 --iterations 8 $v --json; done ;;
    bisect2) CUDA_LAUNCH_BLOCKING=1 step bisect2_blocking 200 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 1000 --iterations 8 --json ;;
    decode) step decode 300 python3 scripts/bench_hicache_stress.py --model qwen3-8b --decode-only --decode-batch 32 --decode-tokens 64 --out "$OUT/decode.json" ;;
    decode_never) step decode_never 300 python3 scripts/bench_hicache_stress.py --model qwen3-8b --decode-only --decode-batch 32 --decode-tokens 64 --decode-policy never --out "$OUT/decode_never.json" ;;
    stress_l3) step stress_l3 300 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tier l3 --policy always --json --out "$OUT/stress_l3.json" ;;
    trace_forward) step trace_forward 300 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2 --policy cost --trace "$OUT/trace"
              for t in none l2; do python3 scripts/trace_kernels.py "$OUT/trace/$t.json.gz"; done; rm -rf "$OUT/trace" ;;
    stress_prof) step stress_prof 300 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2 --policy cost --profile --trace "$OUT/trace" --json --out "$OUT/stress_prof.json" ;;
    stages) step stages 200 python3 scripts/profile_stages.py --model qwen3-8b ;;
    probe_transfer) step probe_transfer 120 python3 scripts/probe_host.py --transfers ;;
    probe_direct_ab) for d in 0 3 7 14 0 3 7 14; do step probe_direct_ab 120 python3 scripts/probe_host.py --transfers --pool-pages 20000 --direct-pages $d; done ;;
    probe_transfer_ab) for a in "" "--pool-pages 1008" "--sleepy" "--pool-pages 1008 --sleepy" "--pool-pages 20000"; do
              step probe_transfer_ab 120 python3 scripts/probe_host.py --transfers $a; done ;;
    probe) step probe 120 python3 scripts/probe_host.py; step probe_contention 60 python3 scripts/probe_contention.py ;;
    spans) step spans 300 python3 scripts/profile_stages.py --model qwen3-8b --spans ;;
    spans_ab) step spans_ab 400 python3 scripts/profile_stages.py --model qwen3-8b --spans --ab split-k ;;
    spans_ab_4b) step spans_ab_4b 400 python3 scripts/profile_stages.py --model qwen3-4b --spans --ab split-k ;;
    spans_pdl) step spans_pdl 400 python3 scripts/profile_stages.py --model qwen3-8b --spans --ab pdl ;;
    pin) step pin 300 python3 scripts/probe_pin.py --gib 64 --torch-gib 8 ;;
    start) step start 300 python3 scripts/probe_start.py --model qwen3-8b --device cuda --l1-tokens 65536 --l2-gib 64 --l3-gib 24 ;;
    probe_sample) step probe_sample 300 python3 scripts/probe_sample.py --json ;;
    sample_sweep) step sample_sweep 300 python3 scripts/probe_sample.py --sweep --batches 1,8,32,64 --iterations 15 ;;
    sampled_ab) i=0; for v in 1 0; do i=$((i+1))  # the rejection kernel (1) and the sort (0) in turn
        HICACHE_SAMPLING_KERNEL=$v step "sampled_k${v}_$i" 300 python3 scripts/bench_engine.py --model qwen3-8b --skip-eager --prefill-tokens 350 --decode-batches 1 --repeats 3 --sampled-decode 32,512,256 --out "$OUT/sampled_k${v}_$i.json"; done ;;
    probe_wait) step probe_wait 200 python3 scripts/probe_wait.py ;;
    chain_wait) step chain_wait 300 python3 scripts/probe_chain_wait.py --model qwen3-8b --rounds 3 ;;
    chain_wait_mem) step chain_wait_mem 300 python3 scripts/probe_chain_wait.py --model qwen3-8b --wait-for memory --rounds 3 ;;
    engine_nopdl) HICACHE_PDL=0 step engine_nopdl 300 python3 scripts/bench_engine.py --model qwen3-8b --profile --skip-eager --out "$OUT/engine_nopdl.json" ;;
    spans_dma) step spans_dma 300 python3 scripts/profile_stages.py --model qwen3-8b --spans --kernel-restore-max-tokens 0 ;;
    stages_fine) step stages_fine 200 python3 scripts/profile_stages.py --model qwen3-8b --fine ;;
    stages_prof) step stages_prof 200 python3 scripts/profile_stages.py --model qwen3-8b --cprofile 45 ;;
    stress_ab) i=0; for k in 0 1024 0 1024; do i=$((i+1)); step "stress_ab${i}_k$k" 200 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2 --policy cost --kernel-restore-max-tokens $k; done ;;
    latency_k) step latency_k 240 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 350,1000,2000 --kernel-restore-max-tokens 2048 --json --out "$OUT/latency_k.json" ;;
    engine_gemm) step engine_gemm 400 python3 scripts/bench_engine.py --model qwen3-8b --small-gemm triton,cublas --skip-eager --prefill-tokens 350,1000 --out "$OUT/engine_gemm.json" ;;
    stress_gemm) i=0; for k in triton cublas triton cublas; do i=$((i+1)); step "stress_gemm${i}_$k" 200 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2 --policy cost --small-gemm $k; done ;;
    stress_wait) i=0; for w in spin block spin block; do i=$((i+1)); step "stress_wait${i}_$w" 200 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2 --policy cost --gpu-wait $w; done ;;
    skinny_split) step skinny_split 400 python3 scripts/bench_kernels.py --skinny-split --out "$OUT/skinny_split.json" ;;
    skinny) step skinny 400 python3 scripts/bench_kernels.py --skinny --out "$OUT/skinny.json" ;;
    layer_copy) step layer_copy 200 python3 scripts/bench_layer_copy.py --model qwen3-8b --out "$OUT/layer_copy.json" ;;
    stress_pages) i=0; for ps in 1 16 1 16; do i=$((i+1)); step "stress_pages${i}_p$ps" 200 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l2 --policy cost --page-size $ps --json --out "$OUT/stress_pages${i}_p$ps.json"; done ;;
    latency_l2_p1) step latency_l2_p1 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 350,1000,2000,3500,8000 --page-size 1 --compare-recompute --json --out "$OUT/latency_l2_p1.json" ;;
    latency_l2_pages) for ps in 4 8; do step "latency_l2_p$ps" 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 1000,3500,8000 --page-size $ps --json --out "$OUT/latency_l2_p$ps.json"; done ;;
    # replay_on / replay_off need the trace inside the repo (the device sees nothing else):
    #   mkdir -p scripts/_tmp && head -1000 ../shared/traces/mooncake_conversation_trace.jsonl > scripts/_tmp/mooncake1000.jsonl
    replay_off) step replay_off 300 python3 scripts/replay_trace.py --trace scripts/_tmp/mooncake1000.jsonl --model qwen3-8b --device cuda --block-tokens 512 --max-requests 1000 --max-input-tokens 4096 --max-output-tokens 8 --time-scale 0 --concurrency 64 --l1-tokens 65536 --no-progress --disable-hicache --json-out "$OUT/replay_off.json" ;;
    replay_on) step replay_on 300 python3 scripts/replay_trace.py --trace scripts/_tmp/mooncake1000.jsonl --model qwen3-8b --device cuda --block-tokens 512 --max-requests 1000 --max-input-tokens 4096 --max-output-tokens 8 --time-scale 0 --concurrency 64 --l1-tokens 65536 --no-progress --l2-gib 64 --l3-gib 24 --json-out "$OUT/replay_on.json" ;;
    latency_l2_p8) step latency_l2_p8 300 python3 scripts/bench_hicache.py --model qwen3-8b --tier l2 --prefix-tokens 1000,3500,8000 --page-size 8 --json --out "$OUT/latency_l2_p8.json" ;;
    transfer_p1) step transfer_p1 200 python3 scripts/bench_transfer.py --page-size 1 --backends triton --out "$OUT/transfer_p1.json" ;;
    stress_outcomes_ab) i=0; for v in "" "--disable-outcomes" "" "--disable-outcomes"; do i=$((i+1))
              step "stress_outcomes_ab$i" 200 python3 scripts/bench_hicache_stress.py --model qwen3-8b --tiers none,l3 --policy cost $v --json --out "$OUT/stress_outcomes_ab$i.json"; done ;;
    graph_ab) step graph_ab 300 python3 scripts/probe_graph_ab.py --contexts 350,1000,3500,8000 ;;
    restore_beside) step restore_beside 300 python3 scripts/probe_restore_beside_forward.py --contexts 350,1000,2000 ;;
    attention) step attention 300 python3 scripts/bench_kernels.py --attention --out "$OUT/attention.json" ;;
    *) echo "unknown step $s" ;;
  esac
done
