#!/usr/bin/env bash
# Runs on the device machine (see docs/CUDA.md): the CUDA op tests, the end-to-end
# comparisons against the CPU backend, and `dsv4 bench` figures.  Needs the bundle
# from `tools/device/bundle.sh build-cuda carry` plus the test binaries in carry/bin (CARRY=DIR: a bundle
# unpacked elsewhere, e.g. a branch's build beside main's in one call; its bin/ and lib/ are used throughout).
# usage: bench/cuda_device.sh STAGE...   stages: synthbg ops gemm e2e diff flash2 pro3 moeoff nograph hf f4 f20 ab
#        abbin bar f20long ktrace ktab ncu ncuix nsys opb smemcold hcdefer hccomb hcab hckt wqbfirst eltest emitlist
#        pools pltest bmforms bmsrc moetest phase topkw topkwt moe1 sprobe topkwkt
#        all = ops gemm e2e flash2 hf f20 ab ktrace f20long (the tests, the transformers baseline, every figure of
#        the issue; ~8 minutes with the 20-layer synth; hf runs before f20, which removes the 2-layer model)
# Logs go to $OUT (or /tmp/cuda-out); a summary is printed last.  OUT_PACK=1 leaves only summary.txt and
# logs.tar.xz there (the rest packed; see the end).
set -u
OUT=${OUT:-/tmp/cuda-out}
mkdir -p "$OUT"
carry=${CARRY:-carry}
export LD_LIBRARY_PATH="$PWD/$carry/lib:${LD_LIBRARY_PATH:-}"
export DSV4_BIN="$PWD/$carry/bin/dsv4"
bin=$carry/bin
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
# one setting of AB_ENVS ("-" none; a comma joins several; "set:NAME=VALUE" a numerics switch)
# into the arrays envs (variables for env) and sets (--set arguments for bench)
parse_setting() {
  envs=(); sets=(); [ "$1" = "-" ] || IFS=, read -r -a envs <<<"$1"
  local i
  for i in "${!envs[@]}"; do
    case ${envs[$i]} in set:*) sets+=(--set "${envs[$i]#set:}"); unset "envs[$i]" ;; esac
  done
}
# synthbg (a stage, best first): the 20-layer synth starts in the background, on the CPUs, while the GPU
# stages that follow run (the tests need no model of 74 GB); it writes /dev/shm/flash20.tmp and renames it when
# done, and every stage but those that read no model of its size waits for it first (wait_synth).  Its argv[0] is
# dsv4-synth-bg, so the pkill between stages (this bundle's $bin/dsv4) leaves it running
# tcase NAME PATTERN SECONDS CMD...: runs CMD (a test binary and its arguments, environment assignments first
# through env) into $OUT/NAME.log, notes its rc and last line, and appends the log's lines that match PATTERN
tcase() {
  local name=$1 pat=$2 secs=$3
  shift 3
  timeout "$secs" env "$@" >"$OUT/$name.log" 2>&1
  note "$name rc=$? $(tail -1 "$OUT/$name.log")"
  grep -E "$pat" "$OUT/$name.log" >>"$summary"
}
# ab_kt NAME SETTING ROUNDS [KT]: ab of SETTING against the default (AB_ROUNDS rounds, else ROUNDS) into
# $OUT/NAME_ab, and with KT non-empty the greedy ktab of the two into $OUT/NAME_kt; their lines into the summary
ab_kt() {
  AB_ROUNDS=${AB_ROUNDS:-$3} AB_ENVS="- $2" OUT="$OUT/$1_ab" bash "$0" ab >/dev/null 2>&1
  grep -E "^ab" "$OUT/$1_ab/summary.txt" >>"$summary"
  [ -n "${4:-}" ] || return 0
  KT_GREEDY=1 AB_ENVS="- $2" OUT="$OUT/$1_kt" bash "$0" ktab >/dev/null 2>&1
  grep -vE "^==" "$OUT/$1_kt/summary.txt" | head -30 >>"$summary"
}
# the window-end pools' tests (stages pltest, pools): their op tests (pool's bits) and the tiny model end to end
pool_tests() {
  tcase pl_ops "^FAIL|pool pre|pool_multi" 120 $bin/test_cuda_ops test_pool_pre test_pool_multi test_pool_device
  tcase pl_e2e "^FAIL|emit list" 400 $bin/test_cuda_e2e test_emit_list
}
# the median (min, max) of the second column of FILE's lines whose first column is KEY (ab's and abbin's ms/step)
median_of() {
  awk -v s="$1" '$1 == s {print $2}' "$2" | sort -n |
    awk '{v[NR] = $1} END {if (NR) printf "%.3f ms/step over %d rounds (min %.2f, max %.2f)", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2, NR, v[1], v[NR]; else printf "no figures"}'
}
# the ms/step of FILE's first line matching PATTERN ("decode batch": the step API's; "greedy decode batch")
ms_of() { grep -E "$1" "$2" | sed -n 's/.* = \([0-9.]*\) ms\/step.*/\1/p' | head -1; }
# flash2_ncu STAGE: the 2-layer Flash synth's path (made if missing) for STAGE's ncu runs; fails (noted) without ncu
flash2_ncu() {
  local m=/dev/shm/flash2
  command -v ncu >/dev/null 2>&1 || { note "$1: ncu not installed" >/dev/null; return 1; }
  [ -d $m ] || timeout 200 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out $m >/dev/null 2>&1
  echo $m
}
synth_pid=
wait_synth() {
  [ -n "$synth_pid" ] || return 0
  wait "$synth_pid"; note "synth flash20 (background) rc=$? in $(( $(date +%s) - synth_t0 )) s"; synth_pid=
}
stages=()
for a in "$@"; do
  if [ "$a" = all ]; then stages+=(ops gemm e2e flash2 hf f20 ab ktrace f20long); else stages+=("$a"); fi
done
for stage in "${stages[@]}"; do
  # a dsv4 left by a stage that timed out still holds its copy of the weights (a second copy of the
  # 20-layer model's 74 GB does not fit): gone before the next stage.  Only this bundle's binary
  # (its command line starts with $bin/dsv4): run elsewhere, `pkill -x dsv4` also killed another
  # checkout's dsv4 (a CI run's synth, 2026-12-02)
  pkill -f "^$bin/dsv4( |\$)" 2>/dev/null && sleep 1
  # only the stages that read no model of /dev/shm, or the 2-layer one, run beside the synth
  case $stage in
  synthbg|ops|gemm|e2e|diff|flash2|hf|moeoff|nograph|eltest|pltest|bmforms|bmsrc|moetest|phase|topkw|topkwt|moe1|sprobe|topkwkt) ;;
  *) wait_synth ;;
  esac
  case $stage in
  synthbg)
    if [ -d /dev/shm/flash20 ]; then note "synthbg: /dev/shm/flash20 already there"; continue; fi
    rm -rf /dev/shm/flash20.tmp /dev/shm/flash4
    mount -o remount,size=110G /dev/shm 2>>"$summary"
    synth_t0=$(date +%s)
    ( (exec -a dsv4-synth-bg "$bin/dsv4" synth --config flash --layers 20 --mtp 0 --seed 1 --out /dev/shm/flash20.tmp \
        >"$OUT/synth20.log" 2>&1) && mv /dev/shm/flash20.tmp /dev/shm/flash20 ) &
    synth_pid=$! ;;
  ops)
    timeout 300 $bin/test_cuda_ops >"$OUT/ops.log" 2>&1; note "ops rc=$? $(tail -1 "$OUT/ops.log")"
    # the one-row FP8 layout of k_gemv_multi (DSV4_CUDA_GM_ROWS=1, read once per process)
    DSV4_CUDA_GM_ROWS=1 timeout 120 $bin/test_cuda_ops test_matmul_multi >"$OUT/ops_gm1.log" 2>&1
    note "ops test_matmul_multi GM_ROWS=1 rc=$? $(tail -1 "$OUT/ops_gm1.log")"
    DSV4_CUDA_GM_MERGE=0 timeout 120 $bin/test_cuda_ops test_matmul_multi >"$OUT/ops_gm0.log" 2>&1
    note "ops test_matmul_multi GM_MERGE=0 rc=$? $(tail -1 "$OUT/ops_gm0.log")"
    # linear.dot=mma's register ring (k_gemv_mma CP = 0; the default takes the cp.async ring at K >= 1024)
    DSV4_CUDA_GMA_CP=0 timeout 120 $bin/test_cuda_linear test_gemv_mma >"$OUT/lin_gma0.log" 2>&1
    note "linear test_gemv_mma GMA_CP=0 rc=$? $(tail -1 "$OUT/lin_gma0.log")"
    grep -E "FAIL|rel|differ|error|identical" "$OUT/ops.log" | head -60 >>"$summary"
    # the indexer's and top-k's other kernels (IX_TILE=0: k_indexer_v / k_indexer_s everywhere; 4: k_indexer_t from
    # 16 keys a block, also below 16; TOPK_SMEM=1: k_topk_s for every row above k)
    DSV4_CUDA_IX_TILE=0 timeout 120 $bin/test_cuda_attn test_indexer test_indexer_rs >"$OUT/attn_ix0.log" 2>&1
    note "attn test_indexer IX_TILE=0 rc=$? $(tail -1 "$OUT/attn_ix0.log")"
    DSV4_CUDA_IX_TILE=4 timeout 120 $bin/test_cuda_attn test_indexer test_indexer_rs >"$OUT/attn_ix4.log" 2>&1
    note "attn test_indexer IX_TILE=4 rc=$? $(tail -1 "$OUT/attn_ix4.log")"
    DSV4_CUDA_TOPK_SMEM=1 timeout 120 $bin/test_cuda_attn test_topk >"$OUT/attn_tk1.log" 2>&1
    note "attn test_topk TOPK_SMEM=1 rc=$? $(tail -1 "$OUT/attn_tk1.log")"
    for t in test_cuda_attn test_cuda_mhc test_cuda_linear test_cuda_moe; do
      [ -x $bin/$t ] || continue
      timeout 300 $bin/$t >"$OUT/$t.log" 2>&1; note "$t rc=$? $(tail -1 "$OUT/$t.log")"
      grep -E "^FAIL" "$OUT/$t.log" | head -20 >>"$summary"
    done ;;
  gemm)
    timeout 300 $bin/test_cuda_gemm >"$OUT/gemm.log" 2>&1; note "gemm rc=$? $(tail -1 "$OUT/gemm.log")"
    grep -vE "^PASS" "$OUT/gemm.log" | head -30 >>"$summary" ;;
  e2e)
    timeout 300 $bin/test_cuda_e2e >"$OUT/e2e.log" 2>&1; note "e2e rc=$? $(tail -1 "$OUT/e2e.log")"
    grep -vE "^PASS" "$OUT/e2e.log" | head -20 >>"$summary" ;;
  diff)
    $bin/dsv4 synth --config tiny --seed 3 --out /tmp/tiny3 >/dev/null 2>&1
    for prof in exact reference; do
      timeout 200 $bin/dsv4 diff --model /tmp/tiny3 --random 70 --a $prof --b $prof,backend=cuda --quiet >"$OUT/diff_$prof.log" 2>&1
      note "diff $prof rc=$? $(tail -1 "$OUT/diff_$prof.log")"; grep -v "uploading" "$OUT/diff_$prof.log" | head -12 >>"$summary"
    done ;;
  flash2)
    t0=$(date +%s)
    timeout 400 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out /dev/shm/flash2 >"$OUT/synth2.log" 2>&1
    note "synth flash2 rc=$? in $(( $(date +%s) - t0 )) s"
    DSV4_CUDA_FLASH2=/dev/shm/flash2 timeout 400 $bin/test_cuda_e2e test_flash2 >"$OUT/e2e_flash2.log" 2>&1
    note "e2e flash2 rc=$? $(tail -1 "$OUT/e2e_flash2.log")"
    grep -vE "^PASS" "$OUT/e2e_flash2.log" | head -20 >>"$summary"
    timeout 300 $bin/dsv4 bench --model /dev/shm/flash2 --backend cuda --prompt 2048 --gen 16 >"$OUT/bench_flash2.log" 2>&1
    note "bench flash2 rc=$?"; cat "$OUT/bench_flash2.log" >>"$summary" ;;
  pro3)
    # V4-Pro's shapes: 3 layers (42 GiB; layers 0-1 ratio 128, layer 2 the indexer), test_pro3 against the
    # CPU backend, then decode figures at 2K (the weights of a Pro layer are ~14 GB: not what one GPU serves,
    # but the kernels' bandwidth at hidden 7168 / 128 heads / inter 3072 is what 8 GPUs would see per layer)
    rm -rf /dev/shm/flash2 /dev/shm/flash4 /dev/shm/flash20
    mount -o remount,size=110G /dev/shm 2>>"$summary"
    t0=$(date +%s)
    [ -d /dev/shm/pro3 ] || timeout 400 $bin/dsv4 synth --config pro --layers 3 --mtp 0 --seed 1 --out /dev/shm/pro3 >"$OUT/synth_pro3.log" 2>&1
    note "synth pro3 rc=$? in $(( $(date +%s) - t0 )) s"
    DSV4_CUDA_PRO3=/dev/shm/pro3 timeout 500 $bin/test_cuda_e2e test_pro3 >"$OUT/e2e_pro3.log" 2>&1
    note "e2e pro3 rc=$? $(tail -1 "$OUT/e2e_pro3.log")"
    grep -vE "^PASS" "$OUT/e2e_pro3.log" | head -20 >>"$summary"
    timeout 300 $bin/dsv4 bench --model /dev/shm/pro3 --backend cuda --prompt 2048 --gen 16 >"$OUT/bench_pro3.log" 2>&1
    note "bench pro3 rc=$?"; grep -v uploading "$OUT/bench_pro3.log" >>"$summary" ;;
  moeoff)
    # A/B of the batch-1 MoE kernels: the bulk-copy path switched off
    DSV4_CUDA_MOE_BULK=0 timeout 300 $bin/dsv4 bench --model /dev/shm/flash2 --backend cuda --prompt 2048 --gen 16 >"$OUT/bench_flash2_moeoff.log" 2>&1
    note "bench flash2 moe bulk off rc=$?"; grep -E "decode|moe|bytes" "$OUT/bench_flash2_moeoff.log" >>"$summary" ;;
  nograph)
    DSV4_CUDA_GRAPHS=0 timeout 300 $bin/dsv4 bench --model /dev/shm/flash2 --backend cuda --prompt 2048 --gen 16 >"$OUT/bench_flash2_nograph.log" 2>&1
    note "bench flash2 graphs off rc=$?"; grep -E "decode|graph|bytes" "$OUT/bench_flash2_nograph.log" >>"$summary" ;;
  hf)
    [ -d /dev/shm/flash2 ] || $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out /dev/shm/flash2 >/dev/null 2>&1
    PYTHONUNBUFFERED=1 timeout 300 python3 bench/hf_baseline.py --config /dev/shm/flash2 --layers 2 --prompt 2048 --gen 16 >"$OUT/hf.log" 2>&1
    note "hf rc=$?"; grep -E "^hf:|Error|error" "$OUT/hf.log" | tail -8 >>"$summary" ;;
  f4)
    rm -rf /dev/shm/flash2
    timeout 200 $bin/dsv4 synth --config flash --layers 4 --mtp 0 --seed 1 --out /dev/shm/flash4 >/dev/null 2>&1
    for args in "--prompt 8192 --gen 8" "--prompt 512 --gen 8 --batch 8" "--prompt 256 --gen 8 --batch 32" "--prompt 32768 --gen 8"; do
      timeout 300 $bin/dsv4 bench --model /dev/shm/flash4 --backend cuda $args >"$OUT/b4.log" 2>&1
      note "bench flash4 $args rc=$?"; grep -E "prefill|decode|bytes|moe|sparse|indexer|topk|matmul |sum" "$OUT/b4.log" >>"$summary"
    done ;;
  f20)
    if [ -f "$OUT/e2e.log" ] && ! tail -1 "$OUT/e2e.log" | grep -q " 0 failed"; then note "f20 skipped: e2e failed"; continue; fi
    rm -rf /dev/shm/flash2 /dev/shm/flash4
    mount -o remount,size=110G /dev/shm 2>>"$summary"
    if [ ! -d /dev/shm/flash20 ]; then
      t0=$(date +%s)
      timeout 300 $bin/dsv4 synth --config flash --layers 20 --mtp 0 --seed 1 --out /dev/shm/flash20 >/dev/null 2>&1
      note "synth flash20 rc=$? in $(( $(date +%s) - t0 )) s; $(du -sh /dev/shm/flash20 | cut -f1)"
    fi
    timeout 400 $bin/dsv4 bench --model /dev/shm/flash20 --backend cuda --prompt ${F20_PROMPTS:-2048,8192} --batch ${F20_BATCHES:-1,8,32} --gen 16 >"$OUT/b20.log" 2>&1
    note "bench flash20 rc=$?"; grep -v uploading "$OUT/b20.log" >>"$summary" ;;
  ab)
    # A/B of environment settings on the 20-layer model (after f20): decode batch 1 at 2K, --gen 32,
    # each setting twice, alternating (the first bench after synth runs slow: a warm-up run first).
    # AB_ENVS: space-separated settings, e.g. "DSV4_CUDA_PDL=0 DSV4_CUDA_PDL=1" ("-" = none; a comma joins
    # several variables into one setting: "A=1,B=2"; an element "set:NAME=VALUE" is a numerics switch,
    # passed as --set NAME=VALUE, e.g. "- set:moe.dot=mma");
    # AB_BATCH: the decode batch of ab and abbin (default 1); AB_ARGS: more bench arguments for every ab run
    # (e.g. "--numerics reference").
    # AB_ROUNDS: rounds (default 2); the last line per setting gives the median of its rounds' ms/step, the
    # step API's and the greedy loop's (only the greedy loop reads DSV4_GREEDY_SEG_LAYERS); the spread between
    # processes of one setting, ~0.1 ms at times, is what more rounds average out
    [ -d /dev/shm/flash20 ] || { note "ab skipped: no /dev/shm/flash20 (run f20 first)"; continue; }
    timeout 100 $bin/dsv4 bench --model /dev/shm/flash20 --backend cuda --prompt 2048 --gen 8 --op-profile 0 >/dev/null 2>&1
    : >"$OUT/ab_ms.txt"; : >"$OUT/ab_greedy_ms.txt"
    for round in $(seq 1 ${AB_ROUNDS:-2}); do
      for setting in ${AB_ENVS:--}; do
        parse_setting "$setting"
        env "${envs[@]}" timeout 100 $bin/dsv4 bench --model /dev/shm/flash20 --backend cuda --prompt 2048 --gen 32 \
          --batch ${AB_BATCH:-1} --op-profile 0 ${AB_ARGS:-} "${sets[@]}" >"$OUT/ab.log" 2>&1
        note "ab round $round [$setting] rc=$? $(grep -E 'prefill|decode batch' "$OUT/ab.log" | sed 's/.*: 32 steps/32 steps/; s/bench: prefill/prefill/' | tr '\n' ' ')"
        ms=$(ms_of 'decode batch' "$OUT/ab.log")
        [ -n "$ms" ] && echo "$setting $ms" >>"$OUT/ab_ms.txt"
        ms=$(ms_of 'greedy decode batch' "$OUT/ab.log")
        [ -n "$ms" ] && echo "$setting $ms" >>"$OUT/ab_greedy_ms.txt"
      done
    done
    for setting in ${AB_ENVS:--}; do
      g=; awk -v s="$setting" '$1 == s {f = 1} END {exit !f}' "$OUT/ab_greedy_ms.txt" &&
        g="; greedy $(median_of "$setting" "$OUT/ab_greedy_ms.txt")"
      note "ab median [$setting] $(median_of "$setting" "$OUT/ab_ms.txt")$g"  # greedy: batch 1 only
    done ;;
  abbin)
    # A/B of two builds on the 20-layer model (after f20): AB_BINS="path/to/dsv4 other/dsv4";
    # same protocol as ab (decode batch 1 at 2K, --gen 32, alternating; AB_ROUNDS rounds, default 2; AB_ARGS and
    # AB_BATCH as for ab); the last lines give each build's median of its greedy ms/step (the device-picks loop)
    [ -d /dev/shm/flash20 ] || { note "abbin skipped: no /dev/shm/flash20 (run f20 first)"; continue; }
    : >"$OUT/abbin_ms.txt"
    for round in $(seq 1 ${AB_ROUNDS:-2}); do
      for b in ${AB_BINS:-$bin/dsv4}; do
        timeout 100 "$b" bench --model /dev/shm/flash20 --backend cuda --prompt 2048 --gen 32 \
          --batch ${AB_BATCH:-1} --op-profile 0 ${AB_ARGS:-} >"$OUT/abbin.log" 2>&1
        note "abbin round $round [$b] rc=$? $(grep -E 'prefill|decode batch' "$OUT/abbin.log" | sed 's/.*: 32 steps/32 steps/; s/bench: prefill/prefill/' | tr '\n' ' ')"
        ms=$(ms_of 'greedy decode batch' "$OUT/abbin.log")
        [ -n "$ms" ] && echo "$b $ms" >>"$OUT/abbin_ms.txt"
      done
    done
    for b in ${AB_BINS:-$bin/dsv4}; do
      note "abbin greedy median [$b] $(median_of "$b" "$OUT/abbin_ms.txt")"
    done ;;
  bar)
    # the issue's bar on the 20-layer model (after synthbg or f20): batch-1 decode at 2K (--gen 32) and 32K
    # (--gen 8), no per-op pass; the device line (card, build flags), the copy rate, the step API's and the
    # greedy loop's ms a step and their % of the copy rate
    [ -d /dev/shm/flash20 ] || { note "bar skipped: no /dev/shm/flash20 (run synthbg or f20 first)"; continue; }
    for a in "2048 32" "32768 8"; do
      read -r pr gen <<<"$a"
      timeout 500 $bin/dsv4 bench --model /dev/shm/flash20 --backend cuda --prompt $pr --gen $gen --op-profile 0 \
        >"$OUT/bar$pr.log" 2>&1
      note "bar $pr rc=$?"
      grep -E "opened in|copy bandwidth|prefill|decode batch|bytes read" "$OUT/bar$pr.log" | sed 's/^bench: /  /' >>"$summary"
    done ;;
  f20long)
    timeout 500 $bin/dsv4 bench --model /dev/shm/flash20 --backend cuda --prompt 32768 --gen 8 >"$OUT/b20long.log" 2>&1
    note "bench flash20 32K rc=$?"; grep -v uploading "$OUT/b20long.log" >>"$summary" ;;
  ktrace)
    # per-kernel device times inside the decode graphs (tools/device/ktrace.c, CUPTI activity
    # records); the CSV comes back compressed and tools/device/ktrace_report.py reads it.
    # KT_ARGS: more bench arguments (e.g. "--set moe.dot=mma"); KT_TAG: a suffix of the CSV's name;
    # KT_GREEDY=1 (ktrace, ktab): bench's greedy pass too, whose device-picks steps are then the trace's last
    # (the report's --steps reads the last passes; default 0: the step API's timed steps are the last)
    m=/dev/shm/flash20; [ -d $m ] || m=/dev/shm/flash2
    if [ -f $carry/lib/ktrace.so ]; then
      CUDA_INJECTION64_PATH=$PWD/$carry/lib/ktrace.so KTRACE_OUT=/tmp/ktrace.csv timeout 300 $bin/dsv4 bench --model $m --backend cuda \
        --prompt ${KT_PROMPT:-2048} --batch ${KT_BATCH:-1} --gen 16 --op-profile 0 --greedy ${KT_GREEDY:-0} ${KT_ARGS:-} \
        >"$OUT/ktrace_run.log" 2>&1
      note "ktrace on $m rc=$? $(wc -l </tmp/ktrace.csv) records"; grep -E "decode|ktrace" "$OUT/ktrace_run.log" >>"$summary"
      xz -T4 -c /tmp/ktrace.csv >"$OUT/ktrace_$(basename $m)_b${KT_BATCH:-1}${KT_TAG:-}.csv.xz"
    else note "ktrace: $carry/lib/ktrace.so missing"; fi ;;
  ktab)
    # per-kernel A/B: a ktrace of each setting of AB_ENVS (ab's syntax: "-" none, a comma joins variables,
    # "set:NAME=VALUE" a numerics switch; AB_ARGS more bench arguments for each), then
    # tools/device/ktrace_report.py --vs of each against the first (ktab_vs<i>.txt; its top 24 rows in the
    # summary) and --overlap of each (ktab_ovl<i>.txt).  Needs /dev/shm/flash20 (f20) or /dev/shm/flash2
    m=/dev/shm/flash20; [ -d $m ] || m=/dev/shm/flash2
    [ -f $carry/lib/ktrace.so ] || { note "ktab: $carry/lib/ktrace.so missing"; continue; }
    i=0; first=
    for setting in ${AB_ENVS:--}; do
      parse_setting "$setting"
      csv="$OUT/ktab$i.csv"
      env "${envs[@]}" CUDA_INJECTION64_PATH=$PWD/$carry/lib/ktrace.so KTRACE_OUT=/tmp/ktab.csv timeout 300 \
        $bin/dsv4 bench --model $m --backend cuda --prompt ${KT_PROMPT:-2048} --batch ${KT_BATCH:-1} --gen 16 \
        --op-profile 0 --greedy ${KT_GREEDY:-0} ${AB_ARGS:-} "${sets[@]}" >"$OUT/ktab_run$i.log" 2>&1
      note "ktab $i [$setting] rc=$? $(grep -E 'decode batch' "$OUT/ktab_run$i.log" | sed 's/.*: 16 steps/16 steps/')"
      xz -T4 -c /tmp/ktab.csv >"$csv.xz"
      # every trace's head starts (ktab_ovl<i>.txt: how far each kernel starts before the ones ahead of it end)
      python3 tools/device/ktrace_report.py "$csv.xz" --steps 16 --top 0 --overlap >"$OUT/ktab_ovl$i.txt" 2>&1
      if [ -z "$first" ]; then first="$csv.xz"
      else
        python3 tools/device/ktrace_report.py "$first" --steps 16 --vs "$csv.xz" --top 40 >"$OUT/ktab_vs$i.txt" 2>&1
        head -28 "$OUT/ktab_vs$i.txt" >>"$summary"
      fi
      i=$((i + 1))
    done ;;
  ncu)
    # hardware counters of the decode kernels (Nsight Compute; works on the Firecracker machines):
    # duration, executed warp instructions, issue-slot use and DRAM throughput per kernel node;
    # NCU_EXTRA: more ncu arguments (e.g. "--section WarpStateStats"); NCU_ARGS: more bench arguments
    # (e.g. "--set moe.dot=mma")
    m=/dev/shm/flash2
    [ -d $m ] || timeout 200 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out $m >/dev/null 2>&1
    if command -v ncu >/dev/null 2>&1; then
      timeout 300 ncu --clock-control none --graph-profiling node -k regex:"${NCU_KERNELS:-k_gemv|k_moe_b1|k_hc_dec}" -c ${NCU_COUNT:-24} \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats --section Occupancy \
        ${NCU_EXTRA:-} $bin/dsv4 bench --model $m --backend cuda --prompt 256 --gen 4 --op-profile 0 ${NCU_ARGS:-} >"$OUT/ncu.log" 2>&1
      note "ncu rc=$? on $m"
      awk '/^  [a-zA-Z_].*\(/ {k=$0; sub(/^ +(void )?/,"",k); sub(/\(.*/,"",k)} /Duration|Executed Instructions  |DRAM Throughput|Issue Slots Busy/ {printf "%s | %s %s\n", k, $1" "$2, $NF}' "$OUT/ncu.log" | head -120 >>"$summary"
    else note "ncu: not installed"; fi ;;
  ncuix)
    # hardware counters of the indexer and top-k kernels at the 32K decode shapes, on test_cuda_attn's bench
    # (8192 and 8198 keys, one row; no model needed): duration, instructions, issue slots, shared-memory
    # wavefronts and bank conflicts, warp stall reasons; the first NCU_COUNT (default 4) calls of each kernel
    if command -v ncu >/dev/null 2>&1; then
      for kn in ${NCU_KERNELS:-k_indexer_t k_topk_s}; do   # the old ones: NCU_ENV="DSV4_CUDA_IX_TILE=0" NCU_KERNELS=k_indexer_v
        env DSV4_ATTN_BENCH=1 ${NCU_ENV:-} timeout 200 ncu --clock-control none --graph-profiling node -k regex:"$kn" \
          -c ${NCU_COUNT:-4} --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
          --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy \
          $bin/test_cuda_attn test_zz_bench >"$OUT/ncuix_$kn.log" 2>&1
        note "ncuix $kn rc=$?"
        grep -E "^  [a-zA-Z_].*\(|Duration|Executed Instructions  |Issue Slots Busy|Bank Conflicts|Stall" \
          "$OUT/ncuix_$kn.log" | head -60 >>"$summary"
      done
    else note "ncu: not installed"; fi ;;
  nsys)
    # kernel-level timeline of decode steps (if the image has Nsight Systems)
    m=/dev/shm/flash20; [ -d $m ] || m=/dev/shm/flash2
    if command -v nsys >/dev/null 2>&1; then
      timeout 300 nsys profile -t cuda --capture-range=cudaProfilerApi -o /tmp/prof -f true $bin/dsv4 bench --model $m --backend cuda --prompt 512 --gen 8 >"$OUT/nsys_run.log" 2>&1
      nsys stats -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o /tmp/profstats /tmp/prof.nsys-rep >/dev/null 2>&1
      head -40 /tmp/profstats_cuda_gpu_kern_sum.csv >"$OUT/nsys_kern.csv" 2>/dev/null
      head -25 /tmp/profstats_cuda_api_sum.csv >"$OUT/nsys_api.csv" 2>/dev/null
      note "nsys rc=$? on $m"; head -15 "$OUT/nsys_kern.csv" >>"$summary"
    else note "nsys: not installed ($(ls /usr/local/cuda/bin 2>/dev/null | tr '\n' ' ' | head -c 300))"; fi ;;
  opb)
    # each weight-reading op of one decode layer alone (dsv4 opbench): warm (weights in L2 where
    # they fit) and cold (after a 256 MB copy) device times; OPB_LAYER (default 3, a ratio-4 layer)
    m=/dev/shm/flash20; [ -d $m ] || m=/dev/shm/flash2
    timeout 120 $bin/dsv4 opbench --model $m --backend cuda --layer ${OPB_LAYER:-3} --reps 100 --flush-mb 256 \
      >"$OUT/opb.log" 2>&1
    note "opbench on $m rc=$?"; grep -v uploading "$OUT/opb.log" | head -40 >>"$summary" ;;
  smemcold)
    # smem_probe's GEMVs (fp32 and MMA, wq_b's shape) with the weights in 4 copies read in turn, so from memory,
    # then opbench's cold figures of the product's kernels in the same lease (the open question of stop 37:
    # the probe's MMA GEMV took 6.57 us against ~10 for the product's when one copy was reread through L2)
    nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/smem_probe.cu -o /tmp/smem_probe >"$OUT/smem.log" 2>&1
    for c in 4 1 4; do timeout 60 /tmp/smem_probe 16 $c >>"$OUT/smem.log" 2>&1; note "smem_probe 16 $c rc=$?"; done
    grep -E "alone|then gemv|copies" "$OUT/smem.log" >>"$summary"
    m=/dev/shm/flash20; [ -d $m ] || m=/dev/shm/flash2
    [ -d $m ] || timeout 100 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out $m >/dev/null 2>&1
    timeout 120 $bin/dsv4 opbench --model $m --backend cuda --flush-mb 512 >"$OUT/opb_cold.log" 2>&1
    note "opbench --flush-mb 512 on $m rc=$?"; grep -E "wq_b|wo_a|wo_b|moe" "$OUT/opb_cold.log" >>"$summary" ;;
  hcdefer)
    # Sinkhorn deferred to the op that reads comb (DSV4_HC_DEFER=1, docs/CUDA.md "Sinkhorn in the reader"): its op
    # and end-to-end tests, then ab (3 rounds) and ktab against the default on the 20-layer model
    timeout 200 $bin/test_cuda_mhc test_post_pre_chain >"$OUT/hcd_mhc.log" 2>&1
    note "test_cuda_mhc test_post_pre_chain rc=$? $(tail -1 "$OUT/hcd_mhc.log")"; grep -E "^FAIL|chain rows" "$OUT/hcd_mhc.log" >>"$summary"
    DSV4_HC_DEFER=1 timeout 300 $bin/test_cuda_e2e >"$OUT/hcd_e2e.log" 2>&1
    note "DSV4_HC_DEFER=1 test_cuda_e2e rc=$? $(tail -1 "$OUT/hcd_e2e.log")"; grep -E "^FAIL" "$OUT/hcd_e2e.log" >>"$summary"
    [ -d /dev/shm/flash2 ] || timeout 100 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out /dev/shm/flash2 >/dev/null 2>&1
    DSV4_HC_DEFER=1 DSV4_CUDA_FLASH2=/dev/shm/flash2 timeout 200 $bin/test_cuda_e2e test_flash2 >"$OUT/hcd_f2.log" 2>&1
    note "DSV4_HC_DEFER=1 test_flash2 rc=$? $(tail -1 "$OUT/hcd_f2.log")"; grep -E "worst|FAIL" "$OUT/hcd_f2.log" | head -6 >>"$summary"
    [ -n "${HC_NOAB:-}" ] && continue # HC_NOAB=1: the tests only (hcab then times both hc switches)
    [ -d /dev/shm/flash20 ] || timeout 150 $bin/dsv4 synth --config flash --layers 20 --mtp 0 --seed 1 --out /dev/shm/flash20 >/dev/null 2>&1
    # (each its own OUT: a run of this script empties its summary)
    AB_ROUNDS=3 ab_kt hcd DSV4_HC_DEFER=1 3 1 ;;
  wqbfirst)
    # wq_b ahead of the first decode list, the list beside it (DSV4_WQB_FIRST, the default since stop 50; "0"
    # the old order; docs/CUDA.md "qa's norm inside wq_b"): its op tests, the end-to-end A/B of logits on
    # flash-2 (made here unless the flash2 stage made it), then ab (AB_ROUNDS, default 3) of =0 against the
    # default on the 20-layer model, and with WQF_KT=1 its ktab
    tcase wqf_lin "^FAIL|beside case|check failed" 120 $bin/test_cuda_linear test_matmul_rn test_list_beside
    [ -d /dev/shm/flash2 ] || timeout 100 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 \
      --out /dev/shm/flash2 >/dev/null 2>&1
    tcase wqf_e2e "^FAIL|qa's norm" 300 DSV4_CUDA_FLASH2=/dev/shm/flash2 $bin/test_cuda_e2e test_qa_fuse
    ab_kt wqf DSV4_WQB_FIRST=0 3 "${WQF_KT:-}" ;;
  eltest)
    # a closed window's tail in one op list (DSV4_EMIT_LIST, default on since stop 50; forward.c run_compressor):
    # the end-to-end tests whose logits it must not change (no 20-layer model needed)
    tcase el_e2e "^FAIL|emit list|side chains" 400 \
      $bin/test_cuda_e2e test_tiny_exact test_side_chain test_emit_list ;;
  emitlist)
    # its A/B on the 20-layer model: ab of DSV4_EMIT_LIST=0 against the default (AB_ROUNDS, default 4), and with
    # EL_KT=1 the ktab of the two
    ab_kt el DSV4_EMIT_LIST=0 4 "${EL_KT:-}" ;;
  pltest)
    # the pools stage's tests only (no 20-layer model needed)
    pool_tests ;;
  phase)
    # the persistent layer's premise (tools/device/phase_probe.cu, stops 55-57; built here with the device's
    # nvcc): both forms (ROWS2 0: one row in flight a warp, 2 blocks an SM; 1: two rows, 1 block) at each
    # PHASE_ARGS "D:STAGE_KB" (default "48:80 16:80 96:80 48:0"); every form's y is checked against the host's
    # first; the forms' us an iteration into the summary
    # PP_BIN=DIR: the probe's two builds made beforehand (DIR/pp0, DIR/pp1: the same nvcc line), no nvcc run here
    for r in 0 1; do
      if [ -n "${PP_BIN:-}" ] && cp "$PP_BIN/pp$r" "$OUT/pp$r"; then :
      elif ! nvcc -O3 -DROWS2=$r -gencode=arch=compute_90a,code=sm_90a tools/device/phase_probe.cu -o "$OUT/pp$r" \
          >"$OUT/pp_build$r.log" 2>&1; then note "phase ROWS2=$r: build failed"; continue; fi
      for a in ${PHASE_ARGS:-48:80 16:80 96:80 48:0}; do
        timeout 60 "$OUT/pp$r" ${a/:/ } >"$OUT/pp${r}_${a/:/_}.log" 2>&1
        note "phase ROWS2=$r D ${a%%:*} STAGE_KB ${a##*:} rc=$?"
        grep -E "BAD|staged|blocks an SM|us an iteration" "$OUT/pp${r}_${a/:/_}.log" | sed 's/^/  /' >>"$summary"
      done
      rm -f "$OUT/pp$r"
    done ;;
  topkw)
    # k_topk_w (built in stop 61; the default for rows of 8193..16384 since stop 62): test_cuda_attn's top-k cases
    # (test_topk_w: a second backend at DSV4_CUDA_TOPK_W=2 and the default one against the CPU's ids), the indexer
    # and top-k alone at 516 and 8198 entries at DSV4_CUDA_TOPK_W=0 / 1 / 2 (test_zz_bench, graph times on), then the
    # 20-layer step at 32K and 2K, the default against =0 (AB_ROUNDS, default 2 at 32K, 1 at 2K; after synthbg)
    tcase topkw_test "^FAIL|topk_w|k_topk_w" 300 $bin/test_cuda_attn test_topk test_topk_w
    for v in 0 1 2; do
      tcase "topkw_bench_$v" "(516|8198) keys" 200 DSV4_ATTN_BENCH=1 DSV4_CUDA_GRAPH_TIMES=1 DSV4_CUDA_TOPK_W=$v \
        $bin/test_cuda_attn test_zz_bench
    done
    wait_synth
    if [ -d /dev/shm/flash20 ]; then
      AB_ROUNDS=${AB_ROUNDS:-2} AB_ARGS="--prompt 32768" AB_ENVS="- DSV4_CUDA_TOPK_W=0" OUT="$OUT/topkw32_ab" \
        bash "$0" ab >/dev/null 2>&1
      grep -E "^ab" "$OUT/topkw32_ab/summary.txt" >>"$summary"
      AB_ROUNDS=1 AB_ENVS="- DSV4_CUDA_TOPK_W=0" OUT="$OUT/topkw2_ab" bash "$0" ab >/dev/null 2>&1
      grep -E "^ab" "$OUT/topkw2_ab/summary.txt" >>"$summary"
    else
      note "topkw: no /dev/shm/flash20 (run synthbg first): no A/B"
    fi ;;
  topkwt)
    # test_cuda_attn's top-k cases only (test_topk, test_topk_w: the staged-counts case of 40 rows included), beside
    # the synth
    tcase topkw_test "^FAIL|topk_w|k_topk_w" 300 $bin/test_cuda_attn test_topk test_topk_w ;;
  sprobe)
    # tools/device/stream_probe.cu (built here by nvcc) at PROBE_MB (default 16.8 33.5 70): grid-stride ldg, bulk rings,
    # a persistent block's contiguous share (chunk), the MoE's grid of 64 / 128 KB shares (share) and its rows
    # interleaved over the blocks (rows), both also through k_moe_b1r's cp.async ring (cpa, cpa-rows), beside the
    # synth (it reads no model)
    if nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/stream_probe.cu -o /tmp/stream_probe \
      >"$OUT/sprobe.log" 2>&1; then
      timeout 150 /tmp/stream_probe ${PROBE_MB:-16.8 33.5 70} >>"$OUT/sprobe.log" 2>&1
      note "sprobe rc=$?"; grep -E "MB|ldg U4|ldg U8|chunk|share|rows|cpa|bytes" "$OUT/sprobe.log" >>"$summary"
    else note "sprobe: nvcc failed"; fi ;;
  moe1)
    # test_cuda_moe's one-row cases only (every A/B geometry against the default's bits), beside the synth; then
    # test_cuda_linear's one-row FP8 GEMV cases with k_gemv8x's proportional split (DSV4_CUDA_G8X_SPLIT=1, the default
    # before stop 64; the default's whole runs run in every other test)
    tcase moe1_test "^FAIL" 300 $bin/test_cuda_moe test_one_row
    tcase g8xsplit_test "^FAIL" 300 DSV4_CUDA_G8X_SPLIT=1 $bin/test_cuda_linear test_gemv8 test_fused_input ;;
  topkwkt)
    # DSV4_CUDA_TOPK_W in the decode graphs without the 20-layer model: a 3-layer Flash synth (layer 2 has the
    # indexer; 11 GB, ~10 s), greedy decode at 32K context at DSV4_CUDA_TOPK_W=0 and =1 (the default) traced, each
    # trace into $OUT/kt3_w<v>.csv.xz (ktrace_report.py --vs of the two: k_topk_s against k_topk_w)
    m3=/dev/shm/flash3
    [ -f $carry/lib/ktrace.so ] || { note "topkwkt: $carry/lib/ktrace.so missing"; continue; }
    [ -d $m3 ] || timeout 100 $bin/dsv4 synth --config flash --layers 3 --mtp 0 --seed 1 --out $m3 >/dev/null 2>&1
    for v in 0 1; do
      DSV4_CUDA_TOPK_W=$v CUDA_INJECTION64_PATH=$PWD/$carry/lib/ktrace.so KTRACE_OUT=/tmp/kt3_$v.csv timeout 120 \
        $bin/dsv4 bench --model $m3 --backend cuda --prompt 32768 --gen 16 --op-profile 0 --greedy 1 \
        >"$OUT/kt3_w$v.log" 2>&1
      note "topkwkt W=$v rc=$? $(grep -E 'greedy decode batch' "$OUT/kt3_w$v.log" | sed 's/.*: 16 steps/16 steps/')"
      xz -T4 -c /tmp/kt3_$v.csv >"$OUT/kt3_w$v.csv.xz"
    done
    rm -rf $m3 ;;
  moetest)
    # test_cuda_moe whole (its every case against the CPU op, the forms' bits)
    tcase moe_all "^FAIL|differ" 300 $bin/test_cuda_moe ;;
  bmforms)
    # moe.dot=mma's kernel forms (stops 53-54): their bits against bm_run (test_one_row_mma_flash: DSV4_CUDA_MOE_BM=2,
    # 3, 4), then ncu of the one-row MoE (8 calls: gate/up and down 4 each) with BM_FORMS (default "4 3", each under
    # --set moe.dot=mma) and the fp32 default: duration, warp instructions, issue slots, the main stall reasons
    # (min .. max over the calls), on the 2-layer Flash synth
    tcase bmf_test "^FAIL|differ|rel" 300 $bin/test_cuda_moe test_one_row_mma_flash
    m=$(flash2_ncu bmforms) || continue
    mets='regex:smsp__average_warps_issue_stalled_(long_scoreboard|wait|not_selected|math_pipe_throttle|barrier)'
    mets+="_per_issue_active.ratio,smsp__inst_executed.sum,gpu__time_duration.sum"
    mets+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
    # BM_PIPES=1: each pipe's share of its peak too (stop 54: which pipe the decode fills)
    [ "${BM_PIPES:-0}" = 1 ] && mets+=",regex:sm__inst_executed_pipe_[a-z0-9_]*\.avg\.pct_of_peak_sustained_active"
    for f in ${BM_FORMS:-4 3} 0; do
      set_mma=(); [ "$f" = 0 ] || set_mma=(--set moe.dot=mma)
      DSV4_CUDA_MOE_BM=$f timeout 200 ncu --clock-control none --graph-profiling node -k regex:k_moe_b1r -c 8 \
        --metrics "$mets" $bin/dsv4 bench --model $m --backend cuda --prompt 256 --gen 6 --op-profile 0 \
        "${set_mma[@]}" >"$OUT/bmf_ncu$f.log" 2>&1
      note "bmforms ncu DSV4_CUDA_MOE_BM=$f ${set_mma[*]} rc=$?"
      awk '/k_moe_b1r</ {k=$2" "$3" "$4" "$5" "$6" "$7" "$8} /duration|inst_executed|issue_active|stalled/ {
             n=$1; sub(/smsp__average_warps_issue_stalled_/, "", n); sub(/_per_issue_active.ratio/, "", n); v=$NF
             gsub(/,/, "", v); v += 0; key=k" | "n
             if (!(key in lo) || v < lo[key]) lo[key]=v; if (!(key in hi) || v > hi[key]) hi[key]=v }
           END {for (key in lo) print "  " key " " lo[key] " .. " hi[key]}' "$OUT/bmf_ncu$f.log" | sort >>"$summary"
    done ;;
  bmsrc)
    # where moe.dot=mma's gate/up (DSV4_CUDA_MOE_BM=BMSRC_FORM, default 4) and the fp32 gate/up spend their time
    # (stop 54): the SASS of both instances (bmsrc_sass*.txt), then ncu of each on the 2-layer Flash synth (2 calls)
    # with its launch statistics, occupancy (waves an SM), warp states and source counters (stall samples an
    # instruction): the details page into the summary, the per-instruction page as CSV, the reports packed.
    # BMSRC_UP=0: the two down instances instead (stop 55: the fp32 down at ~41 % of the copy rate, 55 % issue)
    f=${BMSRC_FORM:-4}; up=${BMSRC_UP:-1}
    m=$(flash2_ncu bmsrc) || continue
    for inst in "$f" 0; do
      case $up$inst in # the instance's mangled template arguments (UP, DEC, S, V, M, MINB, MMA)
      10) kn="k_moe_b1rILi1ELi3ELi4ELi2ELi16ELi4ELi0E" ;; # the fp32 gate/up (DEC 3)
      00) kn="k_moe_b1rILi0ELi2ELi4ELi2ELi16ELi4ELi0E" ;; # the fp32 down (DEC 2)
      *) kn="k_moe_b1rILi${up}ELi2ELi4ELi2ELi16ELi4ELi${inst}E" ;;
      esac
      cuobjdump -sass $bin/dsv4 2>/dev/null |
        awk -v k="$kn" '/Function : / {p = index($0, k) > 0} p' >"$OUT/bmsrc_sass$inst.txt"
      note "bmsrc sass $kn: $(grep -cE '^ +/\*[0-9a-f]{4,}\*/' "$OUT/bmsrc_sass$inst.txt") instructions"
      set_mma=(); [ "$inst" = 0 ] || set_mma=(--set moe.dot=mma)
      DSV4_CUDA_MOE_BM=$f timeout 300 ncu --clock-control none --graph-profiling node --kernel-name-base mangled \
        -k regex:"$kn" -c 2 --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SourceCounters --section SpeedOfLight --section MemoryWorkloadAnalysis -o "$OUT/bmsrc$inst" -f \
        $bin/dsv4 bench --model $m --backend cuda --prompt 256 --gen 6 --op-profile 0 "${set_mma[@]}" \
        >"$OUT/bmsrc_run$inst.log" 2>&1
      note "bmsrc ncu $kn rc=$?"
      ncu -i "$OUT/bmsrc$inst.ncu-rep" --page details >"$OUT/bmsrc_det$inst.txt" 2>&1
      pat="Duration|Waves Per SM|Block Limit|Occupancy|Registers Per|Shared Memory Conf|Dynamic Shared|Grid Size"
      grep -E "$pat|Issued Ipc|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput" "$OUT/bmsrc_det$inst.txt" |
        head -40 | sed 's/^/  /' >>"$summary"
      ncu -i "$OUT/bmsrc$inst.ncu-rep" --page source --csv --print-source sass >"$OUT/bmsrc_src$inst.csv" 2>&1
      note "bmsrc source page rc=$? $(wc -l <"$OUT/bmsrc_src$inst.csv") lines"
    done ;;
  pools)
    # the indexer layers' window-end pools (built in stop 50, first run and made the default in stop 52): a
    # pool's rows asked for at once (DSV4_CUDA_POOL_PRE, attn.cu k_pool_tab / k_pool_jobs) and a step's pools in
    # one launch (DSV4_POOL_MULTI, forward.c pool_flush, attn.cu cu_pool_multi). Their op tests (pool's bits),
    # the tiny model end to end (test_emit_list compares each against its =0; flash-2 has no compressor), then
    # ab of each off and both off against the default (AB_ROUNDS, default 4) on the 20-layer model, and the
    # ktab of both off
    pool_tests
    both=DSV4_CUDA_POOL_PRE=0,DSV4_POOL_MULTI=0
    AB_ROUNDS=${AB_ROUNDS:-4} AB_ENVS="- DSV4_CUDA_POOL_PRE=0 DSV4_POOL_MULTI=0 $both" OUT="$OUT/pl_ab" \
      bash "$0" ab >/dev/null 2>&1
    grep -E "^ab median" "$OUT/pl_ab/summary.txt" >>"$summary"
    KT_GREEDY=1 AB_ENVS="- $both" OUT="$OUT/pl_kt" bash "$0" ktab >/dev/null 2>&1
    grep -vE "^==" "$OUT/pl_kt/summary.txt" | head -30 >>"$summary" ;;
  hccomb)
    # the MoE's combine inside the next hc kernel (DSV4_CUDA_HC_COMB=1, docs/CUDA.md "The combine into hc"): its
    # op test (every output the separate combine's bits; taken only where nothing comes between) and
    # end-to-end tests, flash-2 with it
    timeout 300 $bin/test_cuda_moe test_hc_comb >"$OUT/hcc_moe.log" 2>&1
    note "test_cuda_moe test_hc_comb rc=$? $(tail -1 "$OUT/hcc_moe.log")"
    grep -E "^FAIL|DIFFER" "$OUT/hcc_moe.log" | head -8 >>"$summary"
    grep -E "combine into hc, rows [14] bf16 0, back" "$OUT/hcc_moe.log" >>"$summary"
    timeout 300 $bin/test_cuda_e2e test_hc_comb >"$OUT/hcc_e2e.log" 2>&1
    note "test_cuda_e2e test_hc_comb rc=$? $(tail -1 "$OUT/hcc_e2e.log")"
    grep -E "^FAIL|combine into hc" "$OUT/hcc_e2e.log" >>"$summary"
    [ -d /dev/shm/flash2 ] ||
      timeout 100 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out /dev/shm/flash2 >/dev/null 2>&1
    DSV4_CUDA_HC_COMB=1 DSV4_CUDA_FLASH2=/dev/shm/flash2 timeout 200 $bin/test_cuda_e2e test_flash2 \
      >"$OUT/hcc_f2.log" 2>&1
    note "DSV4_CUDA_HC_COMB=1 test_flash2 rc=$? $(tail -1 "$OUT/hcc_f2.log")"
    grep -E "worst|FAIL" "$OUT/hcc_f2.log" | head -6 >>"$summary" ;;
  hcab|hckt)
    # both hc switches of stop 38/39 against the default on the 20-layer model, and k_gemv's wait first
    # (DSV4_CUDA_GEMV_EARLY=0, the order before stop 39): hcab the ab (3 rounds of five settings, ~6 minutes),
    # hckt the per-kernel A/B of each against the default (greedy, the picks on the device)
    [ -d /dev/shm/flash20 ] ||
      timeout 150 $bin/dsv4 synth --config flash --layers 20 --mtp 0 --seed 1 --out /dev/shm/flash20 >/dev/null 2>&1
    hcs="- DSV4_HC_DEFER=1 DSV4_CUDA_HC_COMB=1 DSV4_HC_DEFER=1,DSV4_CUDA_HC_COMB=1 DSV4_CUDA_GEMV_EARLY=0"
    if [ $stage = hcab ]; then
      AB_ROUNDS=${AB_ROUNDS:-3} AB_ENVS="$hcs" OUT="$OUT/hc_ab" bash "$0" ab >/dev/null 2>&1
      grep -E "^ab" "$OUT/hc_ab/summary.txt" >>"$summary"
    else
      KT_GREEDY=1 AB_ENVS="$hcs" OUT="$OUT/hc_kt" bash "$0" ktab >/dev/null 2>&1
      grep -vE "^==" "$OUT/hc_kt/summary.txt" | head -80 >>"$summary"
    fi ;;
  *) note "unknown stage $stage" ;;
  esac
done
wait_synth
cat "$summary"
# OUT_PACK=1: every file under $OUT but its summary.txt goes into $OUT/logs.tar.xz, so one invocation leaves two
# files (the device tool brings back at most 8; on 2026-12-02 a trace and five logs of a run were left behind). An
# archive already there (an earlier invocation with the same OUT) is unpacked first and repacked with the new files.
if [ "${OUT_PACK:-0}" = 1 ]; then
  (
    cd "$OUT" || exit 1
    if [ -f logs.tar.xz ]; then xz -dc logs.tar.xz | tar -xf - && rm -f logs.tar.xz || exit 1; fi
    files=$(find . -type f ! -path ./summary.txt | sort)
    [ -n "$files" ] || exit 0
    printf '%s\n' "$files" | tar -cf - -T - | xz -T4 >logs.tar.xz &&
      printf '%s\n' "$files" | xargs rm -f && find . -mindepth 1 -type d -empty -delete
  )
fi
