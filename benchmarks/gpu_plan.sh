#!/usr/bin/env bash
# The next GPU session's plan (results/GPU_VALIDATION.md), one step per call of the device machine.
#
#   bash benchmarks/gpu_plan.sh STEP [STEP ...]       STEP: walkroute walkwindow ncusource gluonab fp8wide newgpu routes routecheck fma min4k fp8persistent hoststep stepstate decode16 grids gluon gluonfwd gluonfwdp gluonoverlap fp8gluon ncugluon gluon8 gluonbwd gluontrain gluonwin celltimes gradeclass speed tests0 suite1 suite2 fwd bwd window misc train halves
#
# (PYTHON=... picks the interpreter; python3 by default, the device machine's.)
#
# Each step is sized to finish inside one 10-minute call: its commands run under `timeout` with what is left
# of STEP_BUDGET seconds (default 540), so a hung kernel costs its step, not the session. Logs and JSON land in
# $OUT (the device machine's returned folder; ./gpu_out here), one file per command, and the script's own
# summary in $OUT/plan.log says which command ended how. Where more than 7 files are left beside plan.log (the call
# brings back 8), they are packed into $OUT/out.tar.gz. On a GPU machine, the wheels of
# ../shared/device/fetch-wheels.sh in .whl/ (carried there) are installed to /tmp/site first, as the device
# README asks. `halves` prints the two halves' test files (every tests/test_*.py once).
#
#   speed   the measurements that decide the twenty-seventh session's candidates: tune_fast.py --variants-only
#           (causal, N = 4k and 16k), forward + backward with the flat backward (bench --training --fast-backward),
#           tune_fp8.py --hopper --ws (D = 128); the one-warpgroup specialised launches among them are refused on
#           the H200, where they deadlock (results/ws_smoke_h200.txt), and recorded as errors
#   gluon   lesson 11's Gluon kernels (kernels.hopper_ws, hopper_ws_bwd): their tests and lesson 11 under nbval,
#           then benchmarks/hopper_ws_probe.py (every forward loop checked, then timed beside cuDNN and the
#           course's forward); the probes write after every case, so a step stopped by its budget keeps its rows
#   gluonfwd the probe of `gluon` alone (after suite2, which runs the Gluon tests and lesson 11 under nbval)
#   gluonfwdp the probe's persistent grids with the serial loop, with and without the FMA softmax (causal and not)
#   gluon8  hopper_ws_probe.py --kind fp8: the FP8 entry (hopper_ws.attention_fp8) checked against float32
#           attention on the dequantised inputs, timed beside cuDNN's bf16 and the course's Triton FP8 kernel
#   gluonbwd hopper_ws_probe.py --kind bwd: the Gluon dK/dV kernel (hopper_ws_bwd) with lesson 07's dQ, gradients
#           against float32 autograd, the backward beside lesson 07's pair and cuDNN's
#   grids   issue 24's three benchmarks, full grids, in one call: lesson 08's window grid (W 256/1024/4096, S 0/4,
#           N 4k-64k, one W per process, --quick timing as the recorded grid), decode's grid, the training bench
#           (each bench writes its own files into $OUT; the window grid appends W by W); GRID_RUNS=2 runs them twice,
#           the second run's files in $OUT/run2 (on an H100: about 200 s a run)
#   routes  the three Gluon routes' tests (dispatch.GLUON_MIN_N, fp8.GLUON_MIN_N, fast_backward's gluon mode: off by
#           default, each checked bit for bit against the kernel it routes to) and the bound launches' (launch.py),
#           then gluontrain
#   routecheck benchmarks/route_check.py: each public entry with its Gluon route as shipped against the same call with
#           the route off, forward (plain and window thresholds) and forward + backward (autograd's backward), one process
#   fma     benchmarks/route_check.py --modes fma: the Gluon forward's route with the softmax's scale in one FMA
#           (dispatch.GLUON_FMA) against without it, at every forward point where the route runs, one process, four
#           rounds (the route checks of the same route on and off have read 0.93-1.03x at W = 1024); and --modes
#           persistent: plain attention without the causal mask on the persistent grid against a program per tile
#   hoststep benchmarks/host_step.py --profile: the short window step's host time, layer by layer, through the Gluon
#           backward's route and lesson 07's (HOST_BASE=REV first measures that commit's package the same way, from
#           `git archive REV course_utils`, in the same call; or HOST_BASE=DIR, a folder holding that package, carried)
#   stepstate benchmarks/step_state.py: the window grid's W = 256, 4k training step timed before and after
#           FlexAttention's compile in one process, then with Python's cyclic collector frozen and off (the H200's grid
#           read it at 0.53-0.88 ms, the route check at 0.32 ms); then the first state alone pinned to each NUMA node
#   min4k   benchmarks/route_check.py --modes min4k min4k_noncausal min4k_window, four rounds: the public forward at 4k (B = 4),
#           causal and not, with the Gluon forward's threshold at 4096 (as shipped) against 8192 (the threshold before:
#           lesson 06's kernel at 4k); then lesson 08's windows at 4k (W 1024 / 4096, S 0 / 4) with the window's own
#           threshold (dispatch.GLUON_WINDOW_MIN_N) at 4096 against 8192 as shipped (lesson 08's kernels at 4k). The
#           H200's persistent probe read the Gluon forward with the FMA softmax 1.075x the course's at causal 4k
#           (results/hopper_ws_probe_persistent_h200.json), where the ladder's bf16 entry is furthest under cuDNN
#   fp8persistent benchmarks/route_check.py --modes fp8persistent fp8persistent_noncausal fp8transpose, four
#           rounds: flash_attention_fp8 (e4m3 inputs, N 4k-16k, causal and not) with its Gluon route on the entry's
#           persistent grid (fp8.GLUON_PERSISTENT) against a program per tile, and with V's K-major copy by
#           fp8.transpose_tiled (fp8.FAST_TRANSPOSE) against torch's; then test_hopper_ws.py whole (the launches
#           share their setup and epilogue with that grid now) and the transpose's tests
#   decode16 benchmarks/tune_decode.py at B = 16, 1k and 4k (one and two splits, 2-4 stages): the two decode points
#           furthest under cuDNN in the H200's three grids (0.984-0.996x) run one split at 4 stages, which the H100's
#           sweep put 2% behind 3 stages at 1k
#   gluontrain python -m course_utils.bench --training --gluon: forward + backward with the Gluon backward behind
#           autograd (after the Gluon forward, after the course's) beside lesson 07's pair, SDPA flash and cuDNN
#           (in-process: run it after gluonbwd's probe has shown that the kernels finish)
#   gluonwin hopper_ws_probe.py --kind window: the Gluon forward with lesson 08's window and sinks beside the
#           course's window forward and FlexAttention (180 s a case: Flex compiles in each process)
#   gluonoverlap the forward probe's overlap, overlap + ping-pong and serial variants (bf16, then FP8): FA3's
#           schedules timed again now that ptxas no longer serialises their wgmma (results/sm90_gluon.json)
#   fp8gluon python -m course_utils.bench fp8 --gluon: lesson 11's ladder (N 1k-16k, causal and not, two repeats) with
#           the Gluon bf16 and FP8 forwards beside the course's, SDPA flash and cuDNN (fp8_bench.{json,md} in $OUT)
#   ncugluon Nsight Compute of the Gluon forward's serial loop, FA3's overlap and overlap + ping-pong + FMA, the FP8
#           entry's serial loop and overlap, and lesson 06's two-per-SM kernel, in one run (ncu_forward.py --stem
#           $NCU_STEM, default ncu_forward_h100: name it after the GPU the call got)
#   newgpu  the GPU test files of the thirty-ninth session's changes: test_hopper_ws.py (the window and persistent
#           grids with the FMA softmax, the route with GLUON_FMA; its GPU tests only, not the sm_90 compiles CI runs)
#           and test_gpu_fast_decode.py (B = 1 from 64k on PDL)
#   tests0  the GPU tests no GPU has run yet, with --timeout 120 (a specialised kernel that deadlocks fails alone)
#   ncusource benchmarks/ncu_source.py: Nsight Compute's stall sampling per SASS instruction of lesson 11's Gluon
#           forwards (FP8 with 128- and 256-key tiles, and bf16, the serial loop): which instruction the warps wait at, where ncu_forward.py's
#           totals name only the reason ("barrier"); NCU_STEM names the files after the GPU (default ncu_source_h100)
#   walkroute benchmarks/route_check.py --modes walk walkbwd walkbwd_noncausal, four rounds: the public forward without
#           the causal mask (N 4k-16k) on the persistent grid walked a kv head at a time (dispatch.GLUON_WALK_KV_HEADS)
#           against its default walk, and forward + backward, causal and not, with the Gluon backward walking four kv
#           rows at a time (fast_backward.GLUON_WALK_ROWS) against one row after another (both on as shipped)
#   walkwindow benchmarks/route_check.py --modes fullwindow walkcausal fp8walk fp8walk_noncausal walkwindow, four
#           rounds, in that order: forward + backward with a window as wide as the sequence (W = N = 4096, S 0 / 4)
#           run as plain causal attention (dispatch.window_in_effect, as shipped) against the window's kernels; the
#           plain causal forward (N 4k-16k) with its program per tile walked a kv head at a time
#           (dispatch.GLUON_WALK_CAUSAL, off as shipped) against row by row; flash_attention_fp8 (e4m3 inputs,
#           N 4k-16k, causal and not) with its Gluon route walked a kv head at a time (fp8.GLUON_WALK, off) against
#           its default walk; lesson 08's window on the Gluon route's persistent grid (W 1024 / 4096, S 0 / 4, N 16k
#           and 64k) walked a kv head at a time (dispatch.GLUON_WALK_WINDOWS, off) against its default walk
#   fp8wide benchmarks/route_check.py --modes fp8wide fp8wide_noncausal: flash_attention_fp8 (e4m3 inputs, N 4k-16k)
#           with its Gluon route on the wide tiles of 256 keys (fp8.GLUON_WIDE) against tiles of 128, four rounds
#   gluonab benchmarks/gluon_ab.py: lesson 11's Gluon forwards (FP8 and bf16, as the routes launch them, N 4k-16k)
#           against every earlier copy of the kernels' module present as course_utils/kernels/_NAME_hopper_ws.py (made
#           by `git show REV:course_utils/kernels/hopper_ws.py`, untracked, so carried), against the current module's
#           wide FP8 tiles (attention_fp8(block_n=256), --wide: 2 and 3 slots) and its grids walked a kv head's
#           query heads at a time (--orders), one process, beside cuDNN, and the Gluon backward walked four kv rows at
#           a time (bwd); first the Gluon kernels' tests (test_hopper_ws.py, test_hopper_ws_bwd.py,
#           test_gluon_cpu.py, test_kernels_fp8.py) on the GPU
#   celltimes benchmarks/cell_times.py: every solution notebook top to bottom, each code cell's seconds, appended to a
#           copy of results/cell_times.json in $OUT (the CPU's run is what the README quotes; this is the GPU's)
#   gradeclass benchmarks/grade_class.py --learners 4: the batch grader on a synthetic class of four (lessons 01-05
#           and 07, seconds per learner, peak memory), appended to a copy of results/grade_class.json in $OUT (the
#           README quotes the CPU's runs; a class's grading on a GPU was never measured)
#   suite1  the whole suite, first half: tests/ files up to test_grading_part2.py
#   suite2  the rest of tests/ and nbval over solutions/
#   fwd     tune_fast.py --variants-only (causal and not): the warp-specialised one-warpgroup forward
#   bwd     tune_backward.py --flat and --pair: the flat backward (flat_dq too) and the spill-free pair launches
#   window  tune_window.py --backward (W = 1024, 4096) and --fast (W = 4096)
#   misc    tune_fp8.py --hopper --ws and --maxnreg, tune_decode.py --lean at the two long points
#   train   python -m course_utils.bench --training --fast-backward: forward + backward with lesson 07's pair and with
#           the flat backward (and its flat dQ) behind autograd, beside SDPA flash and cuDNN, in one run
#
# A command that needs no GPU exits at once on a CPU (the tune scripts say there is none), so
# `bash benchmarks/gpu_plan.sh fwd` runs here too (tests/test_tune_scripts.py does).
#
# REQUIRE_GPU=H200 (any part of the GPU's name): run the steps only where nvidia-smi names such a GPU; elsewhere say
# what the machine has, in plan.log, and run nothing (exit 0). A call that names nvidia-h200 may get an H100, and the
# H200's grids should not spend a short budget on another card's numbers. ELSE_STEPS="suite2" (with REQUIRE_GPU): on
# another GPU run those steps instead, so that a call which paid for a machine's start still does work that any
# Hopper card serves (the suite), e.g. `REQUIRE_GPU=H200 ELSE_STEPS=suite2 bash benchmarks/gpu_plan.sh fp8gluon grids`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
BUDGET="${STEP_BUDGET:-540}"
if [[ -n "${REQUIRE_GPU:-}" ]]; then
  found=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)
  if [[ "$found" != *"$REQUIRE_GPU"* ]]; then
    if [[ -z "${ELSE_STEPS:-}" || -z "$found" ]]; then
      echo "REQUIRE_GPU=$REQUIRE_GPU: this machine has ${found:-no NVIDIA GPU}; nothing run" | tee -a "$OUT/plan.log"
      exit 0
    fi
    echo "REQUIRE_GPU=$REQUIRE_GPU: this machine has $found; running ELSE_STEPS instead: $ELSE_STEPS" \
      | tee -a "$OUT/plan.log"
    read -r -a else_steps <<< "$ELSE_STEPS"
    set -- "${else_steps[@]}"
  fi
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if command -v nvidia-smi > /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee -a "$OUT/plan.log"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

START=$SECONDS

# run NAME CMD...: CMD under what is left of the budget (SIGINT first, so pytest still prints its summary)
run() {
  local name=$1; shift
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 20)); then
    echo "$name: not run (budget spent)" | tee -a "$OUT/plan.log"
    return
  fi
  local t0=$SECONDS
  timeout -s INT -k 15 "$left" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s: $*" | tee -a "$OUT/plan.log"
  tail -n 3 "$OUT/$name.log"
}

half() {  # the tests/ files of one half, in name order
  local f
  for f in tests/test_*.py; do
    if [[ $1 == 1 && "$f" < "tests/test_grading_part3" ]] || [[ $1 == 2 && ! "$f" < "tests/test_grading_part3" ]]; then
      echo "$f"
    fi
  done
}

PY="${PYTHON:-python3}"
# One BLAS/OpenMP thread per test process: 15 xdist workers each starting 16 threads on 16 cores slowed the class
# grader's fixtures past a 180-s timeout (06 Dec: 2 workers lost in suite1; with one thread, 145 s and all passed).
PYTEST=(env OMP_NUM_THREADS=1 "$PY" -m pytest -rfE -p no:cacheprovider)
# A kernel that deadlocks blocks its process inside a CUDA call, where no signal reaches Python: pytest-timeout's
# thread method ends that worker (xdist starts another), so a hang costs one test, not the step.
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
  PYTEST+=(--timeout "${TEST_TIMEOUT:-300}" --timeout-method thread)
fi
for step in "$@"; do
  case $step in
    gluon)
      run gluon_tests "${PYTEST[@]}" -n 4 --dist loadfile tests/test_hopper_ws.py tests/test_hopper_ws_bwd.py \
        tests/test_results_hopper.py --nbval-lax --nbval-current-env solutions/11_hopper_and_fp8.ipynb
      run gluon_probe "$PY" benchmarks/hopper_ws_probe.py --out "$OUT/hopper_ws_probe.json" ;;
    gluonfwd)
      run gluon_probe "$PY" benchmarks/hopper_ws_probe.py --out "$OUT/hopper_ws_probe.json" ;;
    gluonfwdp)
      run gluon_probe_persistent "$PY" benchmarks/hopper_ws_probe.py --persistent only --loops serial \
        --out "$OUT/hopper_ws_probe_persistent.json" ;;
    gluonoverlap)
      run gluon_overlap "$PY" benchmarks/hopper_ws_probe.py --loops overlap overlap_pingpong serial \
        --out "$OUT/hopper_ws_probe_overlap.json"
      run gluon8_overlap "$PY" benchmarks/hopper_ws_probe.py --kind fp8 --loops overlap overlap_pingpong serial \
        --out "$OUT/hopper_ws_fp8_probe_overlap.json" ;;
    gluon8)
      run gluon8_probe "$PY" benchmarks/hopper_ws_probe.py --kind fp8 --out "$OUT/hopper_ws_fp8_probe.json" ;;
    gluonbwd)
      run gluonbwd_probe "$PY" benchmarks/hopper_ws_probe.py --kind bwd --out "$OUT/hopper_ws_bwd_probe.json" ;;
    routes)
      run route_tests "${PYTEST[@]}" -n 4 --dist loadfile tests/test_hopper_ws.py tests/test_hopper_ws_bwd.py \
        tests/test_gluon_cpu.py tests/test_launch.py tests/test_gpu_fast_window.py -k "route or gluon_mode or bound"
      run gluontrain "$PY" -m course_utils.bench --training --gluon --n 4096,8192,16384 --out "$OUT/train_gluon" ;;
    grids)
      # GRID_RUNS (default 1) runs of the three, the first into $OUT, the others into $OUT/run2, ... (the issue asks
      # for the spread over two runs); the thirty-fourth session's two grids and a second training run took 340 s
      for ((r = 1; r <= ${GRID_RUNS:-1}; r++)); do
        dir="$OUT" sfx=""
        ((r > 1)) && dir="$OUT/run$r" sfx="_run$r" && mkdir -p "$dir"
        run "window_256$sfx" "$PY" -m course_utils.bench window --quick --windows 256 --sinks 0 4 \
          --ns 4096 8192 16384 32768 65536 --out "$dir"
        for w in 1024 4096; do
          run "window_$w$sfx" "$PY" -m course_utils.bench window --quick --windows "$w" --sinks 0 4 \
            --ns 4096 8192 16384 32768 65536 --append --out "$dir"
        done
        run "decode$sfx" "$PY" -m course_utils.bench decode --out "$dir"
        run "training$sfx" "$PY" -m course_utils.bench --training --out "$dir"
      done ;;
    routecheck)
      run route_check "$PY" benchmarks/route_check.py --out "$OUT/route_check.json" ;;
    fma)
      run route_fma "$PY" benchmarks/route_check.py --modes fma persistent --rounds 4 --out "$OUT/route_check_fma.json" ;;
    min4k)
      run route_min4k "$PY" benchmarks/route_check.py --modes min4k min4k_noncausal min4k_window --rounds 4 \
        --out "$OUT/route_check_min4k.json" ;;
    fp8persistent)
      run route_fp8p "$PY" benchmarks/route_check.py --modes fp8persistent fp8persistent_noncausal fp8transpose \
        --rounds 4 \
        --out "$OUT/route_check_fp8persistent.json"
      run test_fp8p "${PYTEST[@]}" -n 4 tests/test_hopper_ws.py tests/test_kernels_fp8.py -k \
        "hopper_ws or transpose" ;;
    walkroute)
      run route_walk "$PY" benchmarks/route_check.py --modes walk walkbwd walkbwd_noncausal --rounds 4 \
        --out "$OUT/route_check_walk.json" ;;
    walkwindow)
      run route_walkwindow "$PY" benchmarks/route_check.py --rounds 4 --out "$OUT/route_check_walkwindow.json" \
        --modes fullwindow walkcausal fp8walk fp8walk_noncausal walkwindow ;;
    fp8wide)
      run route_fp8wide "$PY" benchmarks/route_check.py --modes fp8wide fp8wide_noncausal --rounds 4 \
        --out "$OUT/route_check_fp8wide.json" ;;
    decode16)
      run tune_decode_b16 "$PY" benchmarks/tune_decode.py --points 16:1024 16:4096 \
        --candidates 64:4:2 64:4:3 64:4:4 128:4:2 --counts 1 2 --out "$OUT/tune_decode_b16.json" ;;
    stepstate)
      run step_state "$PY" benchmarks/step_state.py --out "$OUT/step_state.json"
      for node in 0 1; do
        run "step_state_node$node" "$PY" benchmarks/step_state.py --node "$node" --fresh-only \
          --out "$OUT/step_state_node$node.json"
      done ;;
    hoststep)
      if [[ -d "${HOST_BASE:-}" ]]; then  # a folder holding course_utils (the device's .git may lack the commit)
        run host_step_base "$PY" benchmarks/host_step.py --package "$HOST_BASE"
      elif [[ -n "${HOST_BASE:-}" ]]; then
        base=$(mktemp -d)
        git archive "$HOST_BASE" course_utils | tar -x -C "$base"
        run host_step_base "$PY" benchmarks/host_step.py --package "$base"
      fi
      run host_step "$PY" benchmarks/host_step.py --profile "$OUT/host_step_profile.txt" ;;
    gluontrain)
      run gluontrain "$PY" -m course_utils.bench --training --gluon --n 4096,8192,16384 --out "$OUT/train_gluon" ;;
    ncusource)
      run ncu_source "$PY" benchmarks/ncu_source.py gluon_fp8_serial gluon_fp8_wide gluon_serial --out "$OUT" \
        --stem "${NCU_STEM:-ncu_source_h100}" ;;
    gluonab)
      variants=()
      for f in course_utils/kernels/_*_hopper_ws.py; do
        [[ -e "$f" ]] || continue
        name=$(basename "$f" .py); name=${name#_}; variants+=(--variant "${name%_hopper_ws}=$f")
      done
      run gluon_tests "${PYTEST[@]}" -n 8 --dist loadfile tests/test_hopper_ws.py tests/test_hopper_ws_bwd.py \
        tests/test_gluon_cpu.py tests/test_kernels_fp8.py
      run gluon_ab "$PY" benchmarks/gluon_ab.py "${variants[@]}" --wide --orders --rounds 3 \
        --out "$OUT/gluon_ab.json" ;;
    fp8gluon)
      run fp8_gluon "$PY" -m course_utils.bench fp8 --gluon --repeats 2 --out "$OUT" ;;
    ncugluon)
      run ncu_gluon "$PY" benchmarks/ncu_forward.py --all "$OUT" \
        --kernels gluon_serial gluon_overlap gluon_overlap_pingpong gluon_fp8_serial gluon_fp8_overlap fast_2_per_sm \
        --stem "${NCU_STEM:-ncu_forward_h100}" ;;
    gluonwin)
      run gluonwin_probe "$PY" benchmarks/hopper_ws_probe.py --kind window --limit 180 --persistent only \
        --out "$OUT/hopper_ws_window_probe.json" ;;
    newgpu)
      run newgpu "${PYTEST[@]}" -n 4 --dist loadfile tests/test_hopper_ws.py tests/test_gpu_fast_decode.py \
        -k "hopper_gpu or decode or caches or pdl or paged" ;;
    tests0)
      run tests0 "${PYTEST[@]}" -n 8 --timeout 120 tests/test_gpu_fast.py tests/test_gpu_fast_window.py \
        tests/test_gpu_fast_backward.py tests/test_gpu_fast_decode.py tests/test_kernels_fp8.py \
        tests/test_kernels_fast.py tests/test_kernels_fast_window.py tests/test_kernels_fast_backward.py \
        -k "warp_specialised or flat or decode or persistent or one_loop or autograd" ;;
    celltimes)
      cp results/cell_times.json "$OUT/cell_times.json"
      run celltimes "$PY" benchmarks/cell_times.py --json "$OUT/cell_times.json" ;;
    gradeclass)
      cp results/grade_class.json "$OUT/grade_class.json"
      run gradeclass "$PY" benchmarks/grade_class.py --learners 4 --json "$OUT/grade_class.json" ;;
    suite1)
      run suite1 "${PYTEST[@]}" -n 15 --dist loadfile $(half 1) ;;
    suite2)
      run suite2 "${PYTEST[@]}" -n 15 --dist loadfile $(half 2) --nbval-lax --nbval-current-env solutions/ ;;
    speed)
      run speed_fwd "$PY" benchmarks/tune_fast.py --variants-only --ns 4096 16384 --out "$OUT/tune_fast_variants.json"
      run speed_train "$PY" -m course_utils.bench --training --fast-backward --n 4096,8192,16384 --out "$OUT/train"
      run speed_fp8 "$PY" benchmarks/tune_fp8.py --hopper --ws --head-dims 128 --out "$OUT/tune_fp8_ws.json" ;;
    fwd)
      run fwd_causal "$PY" benchmarks/tune_fast.py --variants-only --ns 4096 16384 --out "$OUT/tune_fast_variants.json"
      run fwd_noncausal "$PY" benchmarks/tune_fast.py --variants-only --case noncausal --ns 4096 16384 \
        --out "$OUT/tune_fast_variants_noncausal.json" ;;
    bwd)
      run bwd_flat "$PY" benchmarks/tune_backward.py --flat --ns 4096 16384 --causal both \
        --out "$OUT/tune_backward_flat.json"
      run bwd_pair "$PY" benchmarks/tune_backward.py --pair --ns 4096 16384 --out "$OUT/tune_backward_pair.json" ;;
    window)
      run window_backward "$PY" benchmarks/tune_window.py --backward --windows 1024 4096 \
        --out "$OUT/tune_window_backward.json"
      run window_fast "$PY" benchmarks/tune_window.py --fast --windows 4096 --out "$OUT/tune_window_fast_ws.json" ;;
    misc)
      run fp8_ws "$PY" benchmarks/tune_fp8.py --hopper --ws --out "$OUT/tune_fp8_ws.json"
      run fp8_maxnreg "$PY" benchmarks/tune_fp8.py --hopper --maxnreg --head-dims 128 --out "$OUT/tune_fp8_maxnreg.json"
      run decode_lean "$PY" benchmarks/tune_decode.py --lean --points 1:65536 1:131072 \
        --out "$OUT/tune_decode_lean.json" ;;
    train)
      run train "$PY" -m course_utils.bench --training --fast-backward --out "$OUT/train" ;;
    halves)
      echo "half 1: $(half 1 | tr '\n' ' ')"
      echo "half 2: $(half 2 | tr '\n' ' ')" ;;
    *)
      echo "unknown step: $step (newgpu routes routecheck fma hoststep grids gluon gluonfwd gluonfwdp gluonoverlap fp8gluon ncugluon gluon8 gluonbwd gluontrain gluonwin celltimes speed tests0 suite1 suite2 fwd bwd window misc train halves)" | tee -a "$OUT/plan.log"
      exit 2 ;;
  esac
done

# The device call brings back at most 8 files from $OUT: where the steps left more, they travel as one archive
# (plan.log stays beside it). The grids step writes 14 files; the first time, the window grid's were lost.
mapfile -t written < <(cd "$OUT" && find . -type f ! -name plan.log ! -name out.tar.gz | sort)
if ((${#written[@]} > 7)); then
  tar czf "$OUT/out.tar.gz" -C "$OUT" "${written[@]}" && (cd "$OUT" && rm -f "${written[@]}") &&
    find "$OUT" -mindepth 1 -type d -empty -delete
  echo "packed ${#written[@]} files into out.tar.gz (tar xzf it)" | tee -a "$OUT/plan.log"
fi
