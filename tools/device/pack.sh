#!/usr/bin/env bash
# Packs a CUDA build for the device machine: tools/device/bundle.sh, the GPU test binaries,
# stripped, into DIR/pack.tar.xz (the tree sent to the device must stay under 64 MiB).
# usage: tools/device/pack.sh BUILD_DIR DIR      then on the device: tar -xJf DIR/pack.tar.xz
set -euo pipefail
build=$1; dir=$2
tools/device/bundle.sh "$build" "$dir" >/dev/null
for t in "$build"/tests/test_cuda_*; do case $t in *.d|*.o) ;; *) cp "$t" "$dir/bin/";; esac; done
# the CUPTI kernel tracer (tools/device/ktrace.c) and its library, when the toolkit has CUPTI
cuda=${CUDA_HOME:-/usr/local/cuda}
if [ -f "$cuda/include/cupti.h" ] && ls "$cuda"/lib*/libcupti.so >/dev/null 2>&1; then
  cc -O2 -shared -fPIC -I"$cuda/include" tools/device/ktrace.c -L"$cuda/lib" -L"$cuda/lib64" -lcupti -o "$dir/lib/ktrace.so"
  cp -L "$(ls "$cuda"/lib*/libcupti.so.[0-9]* | head -1)" "$dir/lib/"
fi
strip "$dir"/bin/* 2>/dev/null || true
# xz -9: a 64 MiB dictionary spans the binaries, which share the statically linked kernels
# (47 MB at the default level, 13 MB at -9 on 2026-12-01; the tree sent to the device is 64 MiB)
# relative to the folder's parent, so it unpacks as DIR/ wherever DIR was given (absolute or not)
tar -C "$(dirname "$dir")" -cf - "$(basename "$dir")" | xz -9 -T2 >/tmp/pack.$$.tar.xz
rm -rf "$dir"; mkdir -p "$dir"; mv /tmp/pack.$$.tar.xz "$dir/pack.tar.xz"
ls -la "$dir/pack.tar.xz"
