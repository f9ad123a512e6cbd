#!/usr/bin/env bash
# Install etmetal's C API under PREFIX: include/etmetal.h, the shared and
# the static library in lib/, and lib/pkgconfig/etmetal.pc, so that
#   cc app.c $(pkg-config --cflags --libs etmetal)
# builds against it (PKG_CONFIG_PATH=PREFIX/lib/pkgconfig when PREFIX is not
# a system one). Build the libraries first:
#   cargo build --release -p etmetal-capi
#   bash crates/etmetal-capi/install.sh /usr/local
# BUILD_DIR (default: $CARGO_TARGET_DIR or target, then /release) is where
# cargo put them. Static linking: `pkg-config --libs --static etmetal` adds
# the system libraries Rust's standard library needs (Libs.private).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
prefix="${1:?usage: install.sh PREFIX [BUILD_DIR]}"
build="${2:-${CARGO_TARGET_DIR:-$here/../../target}/release}"
version="$(sed -n 's/^#define ETMETAL_VERSION "\(.*\)"$/\1/p' "$here/include/etmetal.h")"
case "$(uname -s)" in
    Darwin)
        shared=libetmetal_capi.dylib
        # rustc --print native-static-libs on macOS also names the frameworks
        # wgpu's Metal backend links (docs/EMBEDDING.md); not measured here
        private="-framework Metal -framework QuartzCore -framework CoreGraphics -framework Foundation -lobjc -liconv -lSystem -lc -lm"
        ;;
    *)
        shared=libetmetal_capi.so
        # `cargo rustc -p etmetal-capi --crate-type staticlib -- --print native-static-libs` (x86-64 Linux)
        private="-ldl -lgcc_s -lutil -lrt -lpthread -lm -lc"
        ;;
esac
for f in "$build/$shared" "$build/libetmetal_capi.a"; do
    [ -f "$f" ] || { echo "install.sh: $f is missing: cargo build --release -p etmetal-capi first" >&2; exit 1; }
done
mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
install -m 644 "$here/include/etmetal.h" "$prefix/include/etmetal.h"
install -m 755 "$build/$shared" "$prefix/lib/$shared"
install -m 644 "$build/libetmetal_capi.a" "$prefix/lib/libetmetal_capi.a"
cat > "$prefix/lib/pkgconfig/etmetal.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: etmetal
Description: Run ExecuTorch .pte programs: GPU delegates through wgpu (Metal, Vulkan, DX12), the rest on CPU kernels
Version: $version
Libs: -L\${libdir} -letmetal_capi
Libs.private: $private
Cflags: -I\${includedir}
PC
echo "installed etmetal $version under $prefix"
