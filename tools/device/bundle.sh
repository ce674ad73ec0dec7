#!/usr/bin/env bash
# Bundles a built dsv4 binary with the shared libraries it needs (minus glibc)
# into DIR/bin and DIR/lib, so it runs on the device machine, whose image has
# no jansson/pcre2/microhttpd.  usage: tools/device/bundle.sh BUILD_DIR DIR
set -euo pipefail
build=$1; dir=$2
rm -rf "$dir"; mkdir -p "$dir/bin" "$dir/lib"
cp "$build/dsv4" "$dir/bin/"
ldd "$build/dsv4" | awk '/=> \//{print $3}' | while read -r lib; do
  case "$(basename "$lib")" in libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*|libutil.so*|libnss*|ld-linux*) ;; *) cp -L "$lib" "$dir/lib/";; esac
done
echo "bundled: $(ls "$dir/lib" | tr '\n' ' ')"
