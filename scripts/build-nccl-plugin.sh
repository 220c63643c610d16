#!/usr/bin/env bash
# build-nccl-plugin.sh: builds the NCCL/RCCL net plugin and installs it under
# the file name NCCL opens for NCCL_NET_PLUGIN=metaroce.
#
#   scripts/build-nccl-plugin.sh [DEST_DIR]
#
# cargo names the shared library libmetaroce_nccl.so; NCCL dlopens
# libnccl-net-<NCCL_NET_PLUGIN>.so, so the library is copied to
# DEST_DIR/libnccl-net-metaroce.so (DEST_DIR: target/release by default,
# or $CARGO_TARGET_DIR/release). Then:
#
#   export LD_LIBRARY_PATH=DEST_DIR:$LD_LIBRARY_PATH
#   export NCCL_NET_PLUGIN=metaroce
set -euo pipefail

cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
dest="${1:-$target/release}"
cargo build --release -p metaroce-nccl
mkdir -p "$dest"
cp "$target/release/libmetaroce_nccl.so" "$dest/libnccl-net-metaroce.so"
echo "installed $dest/libnccl-net-metaroce.so"
echo "use it with: LD_LIBRARY_PATH=$(cd "$dest" && pwd):\$LD_LIBRARY_PATH NCCL_NET_PLUGIN=metaroce"
