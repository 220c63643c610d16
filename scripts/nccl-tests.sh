#!/usr/bin/env bash
# nccl-tests.sh: nccl-tests' sendrecv_perf and all_reduce_perf with the
# metaroce plugin against NCCL's own socket transport, on a machine with
# GPUs (NVIDIA: NCCL; AMD: RCCL, which loads the same plugin symbols).
#
#   scripts/nccl-tests.sh [--nccl-tests DIR] [--hosts h1,h2] [--bytes 8:64M]
#
# Needs: nccl-tests built (DIR holds build/sendrecv_perf and
# build/all_reduce_perf; https://github.com/NVIDIA/nccl-tests, or
# rccl-tests on AMD), mpirun for more than one host. Without a GPU
# (neither nvidia-smi nor rocm-smi) it says so and exits 0.
set -euo pipefail

cd "$(dirname "$0")/.."
tests_dir="${NCCL_TESTS_DIR:-}"
hosts=""
bytes="8:64M"
while [ $# -gt 0 ]; do
    case "$1" in
        --nccl-tests) tests_dir="$2"; shift 2 ;;
        --hosts) hosts="$2"; shift 2 ;;
        --bytes) bytes="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L | wc -l)
elif command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showid >/dev/null 2>&1; then
    gpus=$(rocm-smi --showid | grep -c 'GPU\[' || true)
fi
if [ "$gpus" -eq 0 ]; then
    echo "nccl-tests.sh: skipped: no GPU here (neither nvidia-smi nor rocm-smi finds one)."
    echo "Without GPUs, the harness stands in for NCCL: cargo test -p metaroce-nccl,"
    echo "or target/release/metaroce-nccl-harness ... bench (see metaroce-nccl/README.md)."
    exit 0
fi
if [ -z "$tests_dir" ] || [ ! -x "$tests_dir/build/sendrecv_perf" ]; then
    echo "nccl-tests.sh: give the nccl-tests checkout with --nccl-tests DIR (build/sendrecv_perf missing)" >&2
    exit 2
fi

lib="$(pwd)/${CARGO_TARGET_DIR:-target}/release"
scripts/build-nccl-plugin.sh "$lib" >/dev/null
minb="${bytes%%:*}"
maxb="${bytes##*:}"

run() { # label, extra env..., then the test binary
    local label="$1"; shift
    echo "== $label"
    if [ -n "$hosts" ]; then
        local n
        n=$(echo "$hosts" | tr ',' '\n' | wc -l)
        local envs=()
        for e in "$@"; do case "$e" in *=*) envs+=(-x "$e") ;; esac; done
        local bin="${*: -1}"
        mpirun -np "$n" -H "$hosts" -x LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" "${envs[@]}" \
            "$bin" -b "$minb" -e "$maxb" -f 2 -g 1
    else
        env LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" "$@" -b "$minb" -e "$maxb" -f 2 -g "$gpus"
    fi
}

for t in sendrecv_perf all_reduce_perf; do
    # NCCL_IB_DISABLE=1 keeps NCCL off RDMA NICs, so the choice is sockets or metaroce.
    run "$t: NCCL sockets" NCCL_IB_DISABLE=1 NCCL_NET=Socket "$tests_dir/build/$t"
    run "$t: metaroce plugin" NCCL_IB_DISABLE=1 NCCL_NET_PLUGIN=metaroce NCCL_NET=metaroce NCCL_DEBUG=INFO \
        NCCL_DEBUG_SUBSYS=INIT,NET "$tests_dir/build/$t"
done
