#!/usr/bin/env bash
# One call on a GPU machine: install, build, then the named stages in order, each under its own time limit, every
# log under $OUT/logs.tgz and a summary last. A failing stage does not stop the later ones.
#
#   scripts/device_run.sh build mk gputests sweep bench        (stages below; `build` is implied)
#
#   timeline  the megakernel's timeline stamps: cost of every step of a layer and of every grid barrier
#   profile   torch.profiler over engine decode steps at B = 1, 8, 64, 256 (context 512), kernels by category
#   ncustall  Nsight Compute warp-stall reasons of one megakernel launch (B=1, context 512)
#   pytest    the GPU tests named by $PYTEST_ARGS
#   mk        tests/test_megakernel_gpu.py, then scripts/megakernel_bench.py (megakernel vs the graph decode path)
#   gputests  the engine's GPU tests (end to end against HF transformers, kernels, fused ops, GEMM, engine)
#   sweep     the decode-step sweep (ms per step for B = 1..256 against the floor) -> $OUT/decode_steps.jsonl
#   bench     `minillm bench` on the default config, twice -> $OUT/bench.jsonl
#   oldbench  the same bench on the tree in .old/ (the previous commit, exported beforehand) -> $OUT/bench_old.jsonl
#   oldmkbench  scripts/megakernel_bench.py on the tree in .old/ -> $OUT/megakernel_bench_old.jsonl
#   oldsweep  the sweep over the .old/ engine -> $OUT/decode_steps_old.jsonl
#   l2probe   decode GEMMs with cold, L2-resident and prefetched weights -> $OUT/gemm_l2_probe.jsonl
#   checks    `minillm check-kernels --quick` -> $OUT/kernels.jsonl
#   matrix    the start-up matrix; fp8, benchfp8, sweepfp8: the fp8 KV cache; structured: constrained decoding cost
#   parallelab  scripts/parallel_ab.sh: the offline bench on this tree against .old/, interleaved
#   structuredold  structured decode cost, the .old/ tree against this one in alternating processes
#   http      scripts/http_latency.py: latency through the HTTP server vs in-process -> $OUT/latency_http.jsonl
#
# MINILLM_COMMIT names the commit on the results lines (a copied tree may carry a stale .git).
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
LOG=/tmp/device_logs
rm -rf "$LOG" && mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 MINILLM_EXT_DIR="${MINILLM_EXT_DIR:-$PWD/.ext}" COLUMNS=160
: "${MINILLM_COMMIT:?set MINILLM_COMMIT}"
SUMMARY="$LOG/summary.txt"
t_start=$(date +%s)

stage() {   # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  echo "== $name (limit ${limit}s)" | tee -a "$SUMMARY"
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 ))s; tail:" | tee -a "$SUMMARY"
  tail -n 6 "$LOG/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
}

sweep_model() {   # stage name, preset, batch sizes (python tuple), extra LLM keywords: decode steps with dummy weights
  stage "$1" 200 python3 -c "from minillm.config import EngineConfig; \
from minillm.bench.decode_sweep import sweep_and_record; \
sweep_and_record(EngineConfig.from_kwargs('$2', load_format='dummy'${4:-}), '$OUT/decode_steps.jsonl', $3)"
}

tree_commit() {   # the commit a tree's results lines name: this one's, .old's ($OLD_COMMIT), an export's .commit file
  case "$1" in
    .) echo "$MINILLM_COMMIT" ;;
    .old) echo "${OLD_COMMIT:-previous}" ;;
    *) cat "$1/.commit" 2>/dev/null || echo "$1" ;;
  esac
}

python3 -m pip install -q --no-deps --no-build-isolation -e . > "$LOG/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader \
  | tee -a "$SUMMARY"
# build the kernels of .old/ (the previous commit) and of $EXTRA_TREES (stage treesmoe) meanwhile, each its own cache key
for tree in $([[ -d .old ]] && echo .old) ${EXTRA_TREES:-}; do
  (cd "$tree" && MINILLM_COMMIT=$(tree_commit "$tree") PYTHONPATH=$PWD:$PYTHONPATH timeout 400 python3 -c \
    "from minillm.ops.build import load_extension; load_extension()" > "$LOG/build_${tree//[.\/]/}.log" 2>&1) &
done
stage build 240 python3 -c "from minillm.ops.build import load_extension; load_extension(); print('extension ok')"

for s in "$@"; do
  case "$s" in
    build) ;;
    mk)
      stage mk_tests 150 python3 -m pytest -m gpu tests/test_megakernel_gpu.py -x -q -rA --tb=short -p no:cacheprovider
      stage mk_bench 150 python3 scripts/megakernel_bench.py --out "$OUT/megakernel_bench.jsonl" ;;
    mkbench)
      stage mk_bench 150 python3 scripts/megakernel_bench.py --out "$OUT/megakernel_bench.jsonl" ;;
    mkchunks)   # the megakernel's smallest attention partition (kernels.megakernel_min_chunks) at 2 and 4 chunks
      for c in 2 4; do
        stage mk_chunks$c 150 python3 scripts/megakernel_bench.py --batches 1,4,16 --min-chunks $c \
          --out "$OUT/megakernel_bench_chunks.jsonl"
      done ;;
    timeline)   # the megakernel's own per-step timeline (scripts/megakernel_bench.py --timeline)
      stage timeline 150 python3 scripts/megakernel_bench.py --timeline --batches 1,8,16 --contexts 128,512,2048 \
        --out "$OUT/megakernel_timeline.jsonl" ;;
    schedtimeline)   # the timeline under each weight-issue schedule (DecodeMegakernel.forward(schedule=...))
      stage schedtimeline 150 python3 scripts/megakernel_bench.py --timeline --schedules ahead,serial \
        --batches 1,8 --contexts 128,512 --out "$OUT/megakernel_timeline_sched.jsonl" ;;
    profile)   # torch.profiler over engine decode steps: kernels per step by category (scripts/profile_decode.py)
      for b in 1 8 64 256; do
        stage profile_b$b 120 python3 scripts/profile_decode.py --batch $b --context 512 --steps 20 \
          --async-scheduling --output "$OUT/profile_decode_b$b.json"
      done ;;
    pytest)   # GPU tests named by $PYTEST_ARGS (files and -k expressions)
      stage pytest 240 bash -c "python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider $PYTEST_ARGS" ;;
    oldpytest)   # GPU tests named by $PYTEST_ARGS on the tree in .old/ (its own kernels)
      wait
      stage oldpytest 240 bash -c "cd .old && MINILLM_COMMIT=${OLD_COMMIT:-previous} PYTHONPATH=\$PWD:$PYTHONPATH python3 -m \
        pytest -m gpu -q -rf --tb=short -p no:cacheprovider $PYTEST_ARGS" ;;
    e2e)
      stage e2e 200 python3 -m pytest -m gpu -q -rA --tb=short -p no:cacheprovider tests/test_engine_e2e_gpu.py \
        tests/test_engine_gpu.py ;;
    gputests)   # every GPU test file but the start-up matrix (stage matrix) and the 131k-token prompts (slow)
      stage gputests 280 bash -c "python3 -m pytest -m 'gpu and not slow' -q --tb=short -p no:cacheprovider \
        --deselect tests/test_startup_matrix_gpu.py \$(ls tests/test_*gpu*.py | grep -v startup_matrix) \
        tests/test_plan.py tests/test_nonfinite.py | tee $OUT/gputests.log" ;;
    matrix)   # the start-up matrix (scripts/startup_matrix.py --quick): every case in its own process
      stage matrix 240 python3 scripts/startup_matrix.py --quick --jobs 8 --timeout 150 --out "$OUT/startup_matrix.jsonl" ;;
    fp8)   # fp8 KV: decode kernel bytes/s against bf16, next-token KL against a bf16 cache at 512-16k tokens
      stage fp8_timing 120 python3 -c "import json; from minillm.ops.build import load_extension; load_extension(); \
from minillm.diagnostics.kv_quant_check import run_fp8_timings; [print(json.dumps(r)) for r in run_fp8_timings()]"
      cp "$LOG/fp8_timing.log" "$OUT/fp8_timing.jsonl"
      stage fp8_kl 200 python3 scripts/kv_fp8_accuracy.py gpu --out "$OUT/kv_fp8.jsonl" ;;
    kernels3)   # the GPU tests of the fused MoE and prefill kernels; the opt-in wgmma prefill kernels in a run of their
      # own, last, so that a fault there hides nothing
      stage kernels3 200 bash -c "python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider -k 'not wgmma' \
        tests/test_moe_kernels.py tests/test_moe_ops.py tests/test_prefill_kernels.py | tee $OUT/kernels3.log"
      stage wgmma 120 bash -c "python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider -k wgmma \
        tests/test_prefill_kernels.py | tee $OUT/wgmma.log" ;;
    moebench)   # the Qwen3-30B-A3B MoE layer: fused kernels against torch._grouped_mm at 1-256 tokens
      stage moebench 120 python3 scripts/moe_bench.py --out "$OUT/moe_kernels.jsonl" ;;
    moecross)   # the same at prefill sizes: where the fused kernels stop beating grouped_mm
      stage moecross 120 python3 scripts/moe_bench.py --tokens 256,512,1024,2048,4096,16384 --layers 2 \
        --replays 10 --out "$OUT/moe_kernels.jsonl" ;;
    prefillbench)   # the prefill kernels against SDPA at 4k-32k tokens
      stage prefillbench 150 python3 scripts/prefill_bench.py --out "$OUT/prefill_kernels.jsonl" ;;
    abfp8)   # the offline reference with an fp8 cache, then this tree against .old/ with bf16 (one round each)
      stage benchfp8 110 python3 -m minillm bench --no-progress --kv-cache-dtype fp8 --output "$OUT/bench.jsonl"
      stage parallelab 240 env OUT="$LOG/ab" BASE_TREE="$PWD/.old" ROUNDS=1 REQUESTS=256 scripts/parallel_ab.sh
      cp "$LOG"/ab/ab_*.jsonl "$OUT"/ 2>/dev/null ;;
    hoststep)   # host microseconds of LLM.step() with the model math stubbed out (scripts/bench_host_step.py)
      stage hoststep 100 python3 scripts/bench_host_step.py --device cuda --steps 1000
      stage hoststep_seeded 100 python3 scripts/bench_host_step.py --device cuda --steps 1000 --temperature 1.0 --seed
      cp "$LOG"/hoststep*.log "$OUT"/ 2>/dev/null ;;
    fp8dec)   # the fp8 decode kernel: its GPU tests, then fp8 against bf16 decode timings
      stage fp8dec_tests 200 python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider tests/test_kv_fp8_gpu.py \
        tests/test_kernels_gpu.py -k "decode or fp8"
      stage fp8dec_bench 120 python3 scripts/bench_fp8_decode.py --output "$OUT/kv_fp8_decode.jsonl" ;;
    benchfp8)   # the offline reference with an fp8 cache, then bf16, in one run
      stage benchfp8 110 python3 -m minillm bench --no-progress --kv-cache-dtype fp8 --output "$OUT/bench.jsonl"
      stage benchbf16 110 python3 -m minillm bench --no-progress --output "$OUT/bench.jsonl" ;;
    sweepfp8)
      stage sweepfp8 200 python3 -m minillm bench --decode-sweep --no-progress --kv-cache-dtype fp8 \
        -o "$OUT/decode_steps.jsonl" ;;
    structured)   # json_schema-constrained decode steps against unconstrained (scripts/structured_bench.py):
      # masks on a thread beside the host work (default), waited for at once (serial: the A/B of the overlap), in a
      # worker process, on 4 xgrammar threads, with seeds; the profiled run last (the profiler inflates host cost)
      stage structured 100 python3 scripts/structured_bench.py --batches 16,64 --steps 64 \
        --out "$OUT/structured.jsonl"
      stage structured_serial 100 python3 scripts/structured_bench.py --batches 16,64 --steps 64 --serial-masks \
        --out "$OUT/structured.jsonl"
      stage structured_worker 100 python3 scripts/structured_bench.py --batches 16,64 --steps 64 --mask-worker \
        --out "$OUT/structured.jsonl"
      stage structured_threads4 80 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-threads 4 \
        --out "$OUT/structured.jsonl"
      stage structured_seeded 80 python3 scripts/structured_bench.py --batches 64 --steps 64 --seeded \
        --out "$OUT/structured.jsonl"
      for m in "" --serial-masks --mask-worker; do   # the host's side alone (no engine), on this host's cores
        stage "structured_hostpath${m//-/_}" 60 python3 scripts/structured_bench.py --batches 16,64 --host-path 0.5 \
          $m --out "$OUT/structured.jsonl"
      done
      stage structured_profile 100 python3 scripts/structured_bench.py --batches 64 --steps 64 --profile \
        --out "$OUT/structured.jsonl"
      tar -C results/profiles -czf "$OUT/structured_profiles.tgz" $(cd results/profiles && ls structured_* 2>/dev/null) ;;
    structuredquick)   # B=64 only: masks on the thread (default), waited for at once, in the worker process
      for m in "" --serial-masks --mask-worker; do
        stage "structured64${m//-/_}" 80 python3 scripts/structured_bench.py --batches 64 --steps 64 $m \
          --out "$OUT/structured.jsonl"
      done ;;
    structuredwait)   # B=64 all constrained: worker + GPU wait (default), worker + host deferral, thread + GPU wait, serial
      for m in "--mask-worker" "--mask-worker --mask-wait host" "" "--serial-masks"; do
        tag=${m//-/_}; tag=${tag// /}
        stage "structured64${tag}" 80 python3 scripts/structured_bench.py --batches 64 --steps 64 $m \
          --out "$OUT/structured.jsonl"
      done ;;
    structuredab)   # B=64, worker: the A/B of two flag sets, "A|B" in $STRUCTURED_AB (default: 1 against 4 fill
      # threads; e.g. "--mask-workers 1|--mask-workers 2", "--host-threads 1|--host-threads auto"), A B A B, three
      # interleaved rounds a run
      IFS='|' read -r ab_a ab_b <<< "${STRUCTURED_AB:---mask-threads 1|--mask-threads 4}"
      for m in "$ab_a" "$ab_b" "$ab_a" "$ab_b"; do
        tag=${m//-/}; tag=${tag// /_}
        stage "structured64_ab_$tag" 150 python3 scripts/structured_bench.py --batches 64 --steps 64 \
          --mask-worker $m --rounds 3 --out "$OUT/structured.jsonl"
      done ;;
    hostthreads)   # the offline reference with runtime.host_threads 1 against auto (torch's own: 16 here)
      for t in 1 auto; do
        stage bench_hostthreads_$t 110 python3 -m minillm bench --no-progress --set runtime.host_threads=$t \
          --output "$OUT/bench.jsonl"
      done ;;
    structuredcpu)   # B=64 worker, twice, with the host's CPU facts: where slow processes lose their time
      { nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null; cat /proc/loadavg; lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA)"; } \
        > "$OUT/host_cpu.txt" 2>&1
      for r in 1 2; do
        stage structured64_cpu$r 150 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker \
          --rounds 3 --out "$OUT/structured.jsonl"
      done ;;
    structureddiag)   # B=64 in five processes, one before and four after touching 48 GB of host memory, with the
      # host's topology and, per process, the engine thread's busy time and where it and the worker ran
      { nproc; lscpu; lscpu -e; cat /proc/loadavg; } > "$OUT/host_cpu.txt" 2>&1
      stage structured64_cold 60 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker \
        --rounds 2 --placement --out "$OUT/structured.jsonl"
      stage memtouch 60 python3 -c "
import time, numpy as np
keep = []
for i in range(48):
    t = time.perf_counter(); keep.append(np.ones(1 << 27)); print(i, round(time.perf_counter() - t, 3), flush=True)"
      cp "$LOG"/memtouch.log "$OUT"/ 2>/dev/null
      for r in 1 2 3 4; do
        stage structured64_diag$r 60 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker \
          --rounds 2 --placement --out "$OUT/structured.jsonl"
      done ;;
    structuredspy)   # py-spy --native (in .whl) over B=64 unconstrained, then all constrained: where the time goes,
      # not how long (it pauses the process: steps 5-30x slower)
      SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
      for m in none all; do
        stage spy_$m 90 "$SPY" record --native -r 250 -f raw -o "$OUT/spy_$m.txt" -- python3 scripts/structured_bench.py \
          --batches 64 --steps 64 --mask-worker --rounds 2 --modes $m --out "$OUT/structured_spy.jsonl"
      done
      stage hoststep64 120 python3 scripts/bench_host_step.py --device cuda --batch 64 --steps 300 --phases ;;
    structuredidle)   # py-spy without pausing the process, idle samples kept: the engine thread's wall time at B=64
      # unconstrained, then three processes of B=64 (none / all / mixed, three rounds each)
      SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
      stage spyidle 90 "$SPY" record --idle --nonblocking -r 1000 -f raw -o "$OUT/spyidle_none.txt" -- python3 \
        scripts/structured_bench.py --batches 64 --steps 64 --mask-worker --rounds 2 --modes none \
        --out "$OUT/structured_spy.jsonl"
      for r in 1 2 3; do
        stage structured64_r$r 60 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker \
          --rounds 3 --out "$OUT/structured.jsonl"
      done ;;
    structured3)   # B=64 in three processes (three rounds each), then B=16 (the persistent kernel's batch) once
      for r in 1 2 3; do
        stage structured64_p$r 60 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker \
          --rounds 3 --out "$OUT/structured.jsonl"
      done
      stage structured16 60 python3 scripts/structured_bench.py --batches 16 --steps 64 --mask-worker --rounds 2 \
        --out "$OUT/structured.jsonl" ;;
    structuredold)   # B=64 all / half constrained, the tree in .old/ against this one, alternating processes
      wait
      for r in 1 2 3; do
        stage structured64_old$r 70 bash -c "cd .old && MINILLM_COMMIT=${OLD_COMMIT:-previous} PYTHONPATH=\$PWD:$PYTHONPATH \
          python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker --rounds 3 \
          --out $OUT/structured_old.jsonl"
        stage structured64_new$r 70 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-worker \
          --rounds 3 --out "$OUT/structured.jsonl"
      done ;;
    firstcall)   # the first isfinite / exponential_ / argmax over bf16 logits of a fresh process, then the second
      stage firstcall 60 python3 -c "
import time, torch
x = torch.randn(64, 151936, device='cuda').bfloat16(); torch.cuda.synchronize()
for name, f in (('isfinite', lambda: (~torch.isfinite(x).all())), ('exponential_', lambda: torch.empty_like(x, dtype=torch.float32).exponential_()), ('argmax', lambda: x.argmax(-1))):
    for k in range(2):
        t = time.perf_counter(); f(); torch.cuda.synchronize(); print(name, k, round((time.perf_counter() - t) * 1e3, 2), 'ms', flush=True)"
      cp "$LOG"/firstcall.log "$OUT"/ 2>/dev/null ;;
    samplerbench)   # the sampler per call at B = 1..256: top_p 0.9 with the threshold kernel and with the sort
      stage samplerbench 100 python3 scripts/bench_sampler.py --out "$OUT/bench_sampler.jsonl" --batches 1,8,64,256 \
        --iters 50 ;;
    structuredhost)   # the all-constrained B=64 run under cProfile: where building its masks spends host time
      stage structuredhost 100 python3 scripts/structured_bench.py --batches 64 --steps 64 --mask-threads 1 \
        --host-profile --out "$OUT/structured.jsonl"
      cp results/profiles/structured_host_B64.txt "$OUT"/ 2>/dev/null ;;
    parallelab)   # TP=1/DP=1 cost nothing: offline bench, this tree against the one in .old/, interleaved
      stage parallelab 330 env OUT="$LOG/ab" BASE_TREE="$PWD/.old" ROUNDS=2 REQUESTS=256 scripts/parallel_ab.sh
      cp "$LOG"/ab/ab_*.jsonl "$OUT"/ 2>/dev/null ;;
    httpquick)   # scripts/http_latency.py on 120 requests at 4 and 8 req/s: HTTP (engine process) vs in-process
      mkdir -p "$LOG/http"
      stage httpquick 200 python3 scripts/http_latency.py --rates 4,8 --num-requests 120 --engine-process true \
        --output "$LOG/http/latency_http.jsonl"
      cp "$LOG"/http/latency_http.jsonl "$OUT"/ 2>/dev/null ;;
    httpboth)   # httpquick's comparison with 60 requests a rate, plus the server with the engine thread in its process
      mkdir -p "$LOG/http"
      stage httpboth 300 python3 scripts/http_latency.py --rates 4,8 --num-requests 60 --engine-process both \
        --output "$LOG/http/latency_http.jsonl"
      cp "$LOG"/http/latency_http*.jsonl "$OUT"/ 2>/dev/null ;;
    moeprofile)   # torch.profiler over Qwen3-30B-A3B-shape decode steps at B = 1 and 64 (context 512)
      for b in 1 64; do
        stage moeprofile_b$b 150 python3 scripts/profile_decode.py --model qwen3-30b-a3b --batch $b --context 512 \
          --steps 20 --async-scheduling --output "$OUT/profile_decode_moe_b$b.json"
      done ;;
    ttft)   # the long-prompt workload (0.6B) and one 32k prompt on the 0.6B and 8B shapes (after a prefill change)
      stage longprompt 200 python3 -m minillm bench --no-progress --workload configs/workloads/long-prompt.yaml \
        --model qwen3-0.6b --output "$OUT/bench.jsonl"
      for m in qwen3-0.6b qwen3-8b; do
        stage ttft_${m}_32k 150 python3 -m minillm bench --no-progress --workload configs/workloads/ttft-32k.yaml \
          --model $m --output "$OUT/bench.jsonl"
      done ;;
    moekv)   # the MoE preset's KV pool at gpu_memory_utilization 0.9 (kv_cache_tokens of a short offline run)
      stage moekv 120 python3 -m minillm bench --no-progress --model qwen3-30b-a3b --num-requests 16 \
        --output "$OUT/bench_moekv.jsonl" ;;
    hoststep1)   # hoststep without the seeded pass, 400 steps a batch size
      stage hoststep 100 python3 scripts/bench_host_step.py --device cuda --steps 400
      cp "$LOG"/hoststep*.log "$OUT"/ 2>/dev/null ;;
    sweep)
      stage sweep 200 python3 -m minillm bench --decode-sweep --no-progress -o "$OUT/decode_steps.jsonl" ;;
    latency)   # the in-process latency sweep, chunked-2048 at 4 and 8 req/s
      stage latency 240 python3 -m minillm latency-sweep --configs chunked-2048 --rates 4,8 --no-progress \
        -o "$OUT/latency.jsonl" --plot "$LOG/latency.png" ;;
    sweep16)   # the sweep's batch sizes the decode megakernel serves
      stage sweep16 150 python3 -m minillm.bench.decode_sweep --batches 1,2,4,8,16 --output "$OUT/decode_steps.jsonl" ;;
    oldsweep)   # the same sweep (this tree's module) over the previous commit's engine
      wait
      cp minillm/bench/decode_sweep.py .old/minillm/bench/decode_sweep.py
      stage oldsweep 200 bash -c "cd .old && MINILLM_COMMIT=${OLD_COMMIT:-previous} PYTHONPATH=\$PWD:$PYTHONPATH python3 -m \
        minillm.bench.decode_sweep --output $OUT/decode_steps_old.jsonl" ;;
    bench)
      stage bench 200 python3 -m minillm bench --no-progress --repeat 2 --output "$OUT/bench.jsonl" ;;
    oldmkbench)   # megakernel_bench on the tree in .old/ (its own kernels), for an A/B in the same run
      wait
      stage oldmk_bench 150 bash -c "cd .old && MINILLM_COMMIT=${OLD_COMMIT:-previous} PYTHONPATH=\$PWD:$PYTHONPATH python3 \
        scripts/megakernel_bench.py --out $OUT/megakernel_bench_old.jsonl" ;;
    oldbench)
      wait
      stage oldbench 200 bash -c "cd .old && MINILLM_COMMIT=${OLD_COMMIT:-previous} PYTHONPATH=\$PWD:$PYTHONPATH python3 -m minillm \
        bench --no-progress --repeat 2 --output $OUT/bench_old.jsonl" ;;
    ncu)   # Nsight Compute: one megakernel launch at B=1 and B=8 (context 512), full set with source counters
      for b in 1 8; do
        stage ncu_b$b 150 ncu --clock-control none --set full --import-source yes -k regex:megakernel --launch-skip 1 \
          --launch-count 1 -f -o "$LOG/mk_b$b" python3 scripts/megakernel_bench.py --out /dev/null --megakernel-only \
          --batches $b --contexts 512
        ncu -i "$LOG/mk_b$b.ncu-rep" --page details > "$LOG/ncu_b${b}_details.txt" 2>&1
        ncu -i "$LOG/mk_b$b.ncu-rep" --page source --csv --print-source cuda > "$LOG/ncu_b${b}_source.csv" 2>&1
      done ;;
    ncustall)   # Nsight Compute, light: warp stall reasons and scheduler statistics of one B=1 ctx-512 launch
      stage ncustall 150 ncu --clock-control none --section WarpStateStats --section SchedulerStats \
        --section InstructionStats -k regex:megakernel --launch-skip 1 --launch-count 1 -f -o "$LOG/mk_stall" \
        python3 scripts/megakernel_bench.py --out /dev/null --megakernel-only --batches 1 --contexts 512
      ncu -i "$LOG/mk_stall.ncu-rep" --page details --print-details all > "$LOG/ncu_stall_details.txt" 2>&1
      ncu -i "$LOG/mk_stall.ncu-rep" --page raw --csv > "$LOG/ncu_stall_raw.csv" 2>&1 ;;
    http)   # online latency through `minillm serve` against in-process, chunked-2048 at 4 and 8 req/s
      mkdir -p "$LOG/http"
      stage http 500 python3 scripts/http_latency.py --output "$LOG/http/latency_http.jsonl"
      cp "$LOG"/http/*.jsonl "$LOG"/http/*.png "$OUT"/ 2>/dev/null ;;
    l2probe)   # decode GEMMs with cold, L2-resident and prefetched weights (scripts/gemm_l2_probe.py)
      stage l2probe 200 python3 scripts/gemm_l2_probe.py --output "$OUT/gemm_l2_probe.jsonl" ;;
    moeengine)   # the Qwen3-30B-A3B shape end to end: decode sweep and offline reference; moeonline: chunked-2048, 4 req/s
      stage moesweep 200 python3 -m minillm bench --decode-sweep --no-progress --model qwen3-30b-a3b \
        -o "$OUT/decode_steps.jsonl"
      stage moeoffline 200 python3 -m minillm bench --no-progress --model qwen3-30b-a3b --output "$OUT/bench.jsonl" ;;
    moeonline)
      stage moeonline 200 python3 -m minillm latency-sweep --configs chunked-2048 --rates 4 --no-progress \
        --model qwen3-30b-a3b -o "$OUT/latency.jsonl" --plot "$LOG/latency_moe.png" ;;
    longprompt)   # the long-prompt workload (0.6B), then TTFT of one 8k / 32k / 128k prompt, 0.6B and 8B shapes
      stage longprompt 200 python3 -m minillm bench --no-progress --workload configs/workloads/long-prompt.yaml \
        --model qwen3-0.6b --output "$OUT/bench.jsonl"
      for m in qwen3-0.6b qwen3-8b; do
        for w in 8k 32k 128k; do
          model=$m; [[ $w == 128k ]] && model=$m-yarn
          stage ttft_${m}_$w 150 python3 -m minillm bench --no-progress --workload configs/workloads/ttft-$w.yaml \
            --model $model --output "$OUT/bench.jsonl"
        done
      done ;;
    moeab)   # moebench at 1-256 tokens, this tree against the one in .old/, then this tree again (same run)
      wait
      stage moeab_new 150 python3 scripts/moe_bench.py --tokens 1,2,4,8,16,32,64,128,256 --out "$OUT/moe_kernels.jsonl"
      stage moeab_old 150 bash -c "cd .old && MINILLM_COMMIT=${OLD_COMMIT:-previous} PYTHONPATH=\$PWD:$PYTHONPATH \
        python3 scripts/moe_bench.py --tokens 1,2,4,8,16,32,64,128,256 --out $OUT/moe_kernels_old.jsonl"
      stage moeab_new2 150 python3 scripts/moe_bench.py --tokens 1,8,64,256 --out "$OUT/moe_kernels.jsonl" ;;
    treesmoe)   # moebench at 1-256 tokens on this tree, .old/ and each of $EXTRA_TREES, twice over in turn
      wait
      for r in 1 2; do
        for tree in . .old ${EXTRA_TREES:-}; do
          tag=${tree//[.\/]/}; tag=${tag:-new}
          stage "treesmoe_${tag}_$r" 100 bash -c "cd $tree && MINILLM_COMMIT=$(tree_commit "$tree") PYTHONPATH=\$PWD:$PYTHONPATH \
            python3 scripts/moe_bench.py --tokens 1,8,32,64,128,256 --out $OUT/moe_trees.jsonl"
        done
      done ;;
    moeenginebest)   # moeengine on the tree of treesmoe's best fused layer (highest mean TB/s over its token counts)
      best=$(python3 - "$OUT/moe_trees.jsonl" $(for t in . .old ${EXTRA_TREES:-}; do echo "$t=$(tree_commit $t)"; done) <<'PY'
import collections, json, sys
rate = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("impl") == "fused":
        rate[r["commit"]].append(r["tb_s"])
best = max(rate, key=lambda c: sum(rate[c]) / len(rate[c]))
print(next(t for t, c in (a.split("=", 1) for a in sys.argv[2:]) if c == best))
PY
)
      commit=$(tree_commit "$best")
      echo "   best tree $best ($commit)" | tee -a "$SUMMARY"
      stage moesweep_best 200 bash -c "cd $best && MINILLM_COMMIT=$commit PYTHONPATH=\$PWD:$PYTHONPATH python3 -m minillm \
        bench --decode-sweep --no-progress --model qwen3-30b-a3b -o $OUT/decode_steps.jsonl"
      stage moeoffline_best 200 bash -c "cd $best && MINILLM_COMMIT=$commit PYTHONPATH=\$PWD:$PYTHONPATH python3 -m minillm \
        bench --no-progress --model qwen3-30b-a3b --output $OUT/bench.jsonl" ;;
    ncumoe)   # Nsight Compute, basic set: each kernel of one Qwen3-30B-A3B MoE layer at $NCU_MOE_TOKENS tokens, alone
      for t in ${NCU_MOE_TOKENS:-1 8}; do
        stage ncumoe_t$t 120 ncu --clock-control none --set basic -k "regex:moe_route_gemv|moe_gate_up|moe_down" \
          --launch-count 6 \
          -f -o "$LOG/moe_t$t" python3 scripts/moe_bench.py --out /dev/null --tokens $t --layers 1 --replays 2
        ncu -i "$LOG/moe_t$t.ncu-rep" --page details > "$OUT/ncu_moe_t$t.txt" 2>&1
      done ;;
    ncumoefull)   # Nsight Compute, full set: gate_up and down of one Qwen3-30B-A3B MoE layer at 64 tokens, one launch each
      stage ncumoefull 150 ncu --clock-control none --set full -k "regex:moe_gate_up|moe_down_kernel" --launch-count 2 \
        -f -o "$LOG/moe_full_t64" python3 scripts/moe_bench.py --out /dev/null --tokens 64 --layers 1 --replays 1
      ncu -i "$LOG/moe_full_t64.ncu-rep" --page details --print-details all > "$OUT/ncu_moe_full_t64.txt" 2>&1 ;;
    moechain)   # moebench at 1-16 tokens with the launch chain the one-launch variants replace (--chain)
      stage moechain 120 python3 scripts/moe_bench.py --tokens 1,2,4,8,16 --chain --out "$OUT/moe_kernels.jsonl" ;;
    moesweep1)   # the Qwen3-30B-A3B preset's decode step at B = 1 and 8 (dummy weights)
      sweep_model moesweep1 qwen3-30b-a3b "(1, 8)" ;;
    moevariants)   # moebench at 1-32 tokens with each small-step variant pair forced (sets moe_ops' two constants)
      stage moevariants 150 python3 scripts/moe_bench.py --tokens 1,2,4,8,12,16,24,32 --variants \
        --out "$OUT/moe_kernels.jsonl" ;;
    mkshapes)   # megakernel_bench on other shapes ($MK_MODELS); where the megakernel refuses one, the graph path alone
      for m in ${MK_MODELS:-qwen3-1.7b qwen2.5-0.5b qwen2.5-1.5b}; do
        stage mkbench_$m 200 python3 scripts/megakernel_bench.py --model $m --batches 1,8,16 --contexts 128,2048 \
          --replays 100 --out "$OUT/megakernel_bench.jsonl"
      done ;;
    modelsweep)   # engine decode steps at B = 1, 8, 16 of $SWEEP_MODELS (dummy weights), the megakernel on, then off
      for m in ${SWEEP_MODELS:-qwen3-1.7b qwen2.5-0.5b}; do
        for on in True False; do sweep_model "sweep_${m}_mk$on" "$m" "(1, 8, 16)" ", megakernel=$on"; done
      done ;;
    readprobe)   # scripts/weight_read_probe.cu: HBM read rate of the decode GEMMs' load pattern against coalesced and bulk copies
      stage readprobe 120 bash -c "nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/weight_read_probe scripts/weight_read_probe.cu \
        && /tmp/weight_read_probe | python3 -c 'import json, sys; from minillm.fingerprint import stamp; \
[print(json.dumps({**json.loads(l), **stamp()})) for l in sys.stdin if l.strip()]' | tee $OUT/weight_read_probe.jsonl" ;;
    gemmsweep)   # scripts/gemm_sweep.py --quick: cuBLAS, the skinny GEMM and the decode GEMM at decode M, 0.6B and 8B shapes
      stage gemmsweep 200 python3 scripts/gemm_sweep.py --quick --output "$OUT/gemm_sweep.jsonl" ;;
    moebench1)   # moebench at 1 and 8 tokens only
      stage moebench1 90 python3 scripts/moe_bench.py --tokens 1,8 --out "$OUT/moe_kernels.jsonl" ;;
    ncuprefill)   # Nsight Compute, full set: one launch of the default prefill kernel on sm_90, T=4096 causal, 16/8 heads
      stage ncuprefill 200 ncu --clock-control none --set full -k regex:paged_prefill_wgmma --launch-count 1 -f \
        -o "$LOG/prefill_wgmma" python3 scripts/prefill_bench.py --out /dev/null --lengths 4096
      ncu -i "$LOG/prefill_wgmma.ncu-rep" --page details --print-details all > "$OUT/ncu_prefill_wgmma.txt" 2>&1 ;;
    checks)
      stage checks 300 python3 -m minillm check-kernels --quick --output "$OUT/kernels.jsonl" ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done
wait
echo "total $(( $(date +%s) - t_start ))s, commit $MINILLM_COMMIT" | tee -a "$SUMMARY"
cp "$SUMMARY" "$OUT/summary.txt"
tar -C "$LOG" -czf "$OUT/logs.tgz" .
