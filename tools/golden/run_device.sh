#!/usr/bin/env bash
# Device-machine driver for the golden vectors: synthesizes checkpoints with the
# bundled dsv4 (tools/device/bundle.sh BUILD carry), runs transformers on them
# (golden.py) and, as a first check, compares dsv4's own exact logits (compare.py).
# usage: tools/golden/run_device.sh OUTDIR [tiny|nvfp4|flash2 ...]
set -uo pipefail
out=$1; shift
export LD_LIBRARY_PATH=$PWD/carry/lib PYTHONUNBUFFERED=1
D=$PWD/carry/bin/dsv4
mkdir -p "$out"
run_case() { # name synth-args T seed
  local name=$1 sargs=$2 T=$3 seed=$4 dir=/tmp/golden-$1
  echo "=== $name: dsv4 synth $sargs"
  rm -rf "$dir"; $D synth $sargs --out "$dir" || return 1
  python3 tools/golden/golden.py --model "$dir" --name "$name" --T "$T" --seed "$seed" --out "$out" \
      --synth "dsv4 synth $sargs" || return 1
  /usr/bin/time -v $D logits --model "$dir" --tokens-file "$out/$name.tokens" --out "/tmp/$name.ours.f32" 2>/tmp/$name.time
  grep -E "Elapsed|Maximum resident" /tmp/$name.time
  python3 tools/golden/compare.py "$out/$name" "/tmp/$name.ours.f32"
  for p in reference; do
    $D logits --model "$dir" --numerics $p --tokens-file "$out/$name.tokens" --out "/tmp/$name.$p.f32" >/dev/null &&
    python3 tools/golden/compare.py "$out/$name" "/tmp/$name.$p.f32" | sed "s/^/[$p profile, expected to differ] /"
  done
  case "$name" in flash2*) rm -rf "$dir";; esac
}
for c in "$@"; do
  case $c in
    tiny) run_case tiny_s1 "--config tiny --seed 1" 320 7 ;;
    nvfp4) run_case tiny_nvfp4_s2 "--config tiny --seed 2 --experts nvfp4" 200 8 ;;
    flash2) run_case flash2_s1 "--config flash --layers 2 --mtp 0 --seed 1" 12 9 ;;
  esac
done
