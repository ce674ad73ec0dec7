#!/usr/bin/env bash
# Packs a CUDA build for the device machine: tools/device/bundle.sh, the GPU test binaries,
# stripped, into DIR/pack.tar.xz (the tree sent to the device must stay under 64 MiB).
# usage: tools/device/pack.sh BUILD_DIR DIR      then on the device: tar -xJf DIR/pack.tar.xz
set -euo pipefail
build=$1; dir=$2
tools/device/bundle.sh "$build" "$dir" >/dev/null
for t in "$build"/tests/test_cuda_*; do case $t in *.d|*.o) ;; *) cp "$t" "$dir/bin/";; esac; done
strip "$dir"/bin/* 2>/dev/null || true
tar -cJf /tmp/pack.$$.tar.xz "$dir"
rm -rf "$dir"; mkdir -p "$dir"; mv /tmp/pack.$$.tar.xz "$dir/pack.tar.xz"
ls -la "$dir/pack.tar.xz"
