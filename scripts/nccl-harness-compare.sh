#!/usr/bin/env bash
# nccl-harness-compare.sh: the NCCL plugin's harness against `metaroce perf`
# on the same path, rounds alternated (docs/BENCHMARKS.md, "NCCL plugin").
#
#   scripts/nccl-harness-compare.sh [ROUNDS] [loopback|fabric|all]
#
# Per round and path: the harness's 8 B round trip p50 (20,000 ping-pongs)
# against `metaroce perf --op send -s 8 -t 1` latency p50 (busy-polling, its
# default, and sleeping, --busy-poll 0); the harness's 8 MiB per-direction
# bandwidth (both ranks send and receive, 512 KiB pieces, 8 outstanding, as
# NCCL pipelines) against `metaroce perf --op send -s 512K -t 8 --bidir`, per
# direction. `fabric` (root) builds `metaroce fabric up --spines 4` and runs
# each round lossless and at 1% loss, with 16 paths, and there also TCP in
# NCCL's socket-transport shape (`iperf3 -P 4 --bidir`: 4 streams each way,
# per direction); it is torn down at exit. Prints one line per round and
# path, and the ratios.
set -euo pipefail

cd "$(dirname "$0")/.."
rounds="${1:-3}"
which="${2:-loopback}"
target="${CARGO_TARGET_DIR:-target}"
plug="$(mktemp -d /tmp/mr-nccl-cmp.XXXXXX)"
prefix="mrnc$$"
cleanup() {
    if [ "$which" != loopback ]; then
        METAROCE_FABRIC_PREFIX="$prefix" "$target/release/metaroce" fabric down >/dev/null 2>&1 || true
    fi
    rm -rf "$plug"
}
trap cleanup EXIT

cargo build --release -q -p metaroce-cli -p metaroce-nccl
cp "$target/release/libmetaroce_nccl.so" "$plug/libnccl-net-metaroce.so"
H="$target/release/metaroce-nccl-harness"
P="$target/release/metaroce"
export LD_LIBRARY_PATH="$plug"

# run_in NS CMD...: CMD in namespace NS (or here, for "-"), replacing the
# shell that runs it, so that a background run's $! is CMD's own pid.
run_in() {
    local ns="$1"
    shift
    if [ "$ns" = - ]; then exec "$@"; else exec ip netns exec "$ns" "$@"; fi
}

# harness NS0 ADDR0 NS1 ADDR1 ARGS...: rank 1 in the background, rank 0's JSON.
harness() {
    local ns0="$1" a0="$2" ns1="$3" a1="$4"
    shift 4
    local rv
    rv="$(mktemp -d /tmp/mr-nccl-rv.XXXXXX)"
    (run_in "$ns1" env METAROCE_ADDRS="$a1" $EXTRA "$H" --rank 1 --rendezvous "$rv" "$@" --json bench >/dev/null 2>"$plug/rank1.err") &
    local pid=$!
    (run_in "$ns0" env METAROCE_ADDRS="$a0" $EXTRA "$H" --rank 0 --rendezvous "$rv" "$@" --json bench 2>"$plug/rank0.err") || true
    wait "$pid" || true
    rm -rf "$rv"
}

# perf_json NS0 NS1 SERVER ARGS...: a perf client in NS0 against a server in NS1.
perf_json() {
    local ns0="$1" ns1="$2" server="$3"
    shift 3
    if [ "$ns0" = - ]; then
        "$P" perf "$@" --json 2>"$plug/perf.err" || true
        return
    fi
    (run_in "$ns1" "$P" perf server --bind "$server" >/dev/null 2>"$plug/server.err") &
    local pid=$!
    sleep 0.5
    (run_in "$ns0" "$P" perf client "$server" "$@" --json 2>"$plug/perf.err") || true
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

py_rtt='import json,sys; print(round(json.load(sys.stdin)["rtt_8b_us"]["p50"],1))'
py_bw='import json,sys; d=json.load(sys.stdin); r=[x for x in d["sendrecv"] if x["size"]==8<<20][0]; print(round(r["algbw_gbps"]*8,3))'
py_lat='import json,sys; print(round(json.load(sys.stdin)["lat_p50_us"],1))'
py_dir='import json,sys; d=json.load(sys.stdin); print(round((d["tx"]["gbps"]+d["rx"]["gbps"])/2,3))'

# parse PY WHAT: what PY prints of the JSON on stdin; "fail" if there is
# none, with the last lines the runs wrote to stderr (rank0.err, ...).
parse() {
    local out
    if out=$(python3 -c "$1" 2>/dev/null); then
        echo "$out"
    else
        echo "nccl-harness-compare: $2 gave no result; its stderr:" >&2
        for f in "$plug"/*.err; do
            [ -s "$f" ] && { echo "  ${f##*/}:"; tail -n 5 "$f" | sed 's/^/    /'; }
        done >&2
        echo fail
    fi
}

# one PATHNAME NS0 ADDR0 NS1 ADDR1 SERVER PERF_EXTRA...
one() {
    local name="$1" ns0="$2" a0="$3" ns1="$4" a1="$5" server="$6"
    shift 6
    local hl p50 p0 hb pb
    rm -f "$plug"/*.err
    hl=$(harness "$ns0" "$a0" "$ns1" "$a1" --max-size 8 --iters 5 --pingpongs 20000 | parse "$py_rtt" "$name: harness 8 B")
    p50=$(perf_json "$ns0" "$ns1" "$server" --op send -s 8 -t 1 -D 2 "$@" | parse "$py_lat" "$name: perf 8 B")
    p0=$(perf_json "$ns0" "$ns1" "$server" --op send -s 8 -t 1 -D 2 --busy-poll 0 "$@" | parse "$py_lat" "$name: perf 8 B sleeping")
    hb=$(harness "$ns0" "$a0" "$ns1" "$a1" --max-size 8M --iters 20 --pingpongs 100 | parse "$py_bw" "$name: harness 8 MiB")
    pb=$(perf_json "$ns0" "$ns1" "$server" --op send -s 512K -t 8 -D 3 --bidir "$@" | parse "$py_dir" "$name: perf 512 KiB")
    case " $hl $p50 $p0 $hb $pb " in
    *" fail "*)
        echo "$name: round failed (harness $hl us, perf $p50 / $p0 us, harness $hb, perf $pb Gbit/s)"
        return 0
        ;;
    esac
    local tcp=0
    if [ "$ns0" != - ]; then
        tcp=$(tcp4 "$ns0" "$ns1" "${server%:*}")
    fi
    python3 - "$name" "$hl" "$p50" "$p0" "$hb" "$pb" "$tcp" <<'EOF'
import sys
n, hl, p50, p0, hb, pb, tcp = sys.argv[1], *map(float, sys.argv[2:])
t = f"  TCP x4 {tcp:6.3f} (x{hb/tcp:.2f})" if tcp > 0 else ""
print(f"{n:12} rtt harness {hl:7.1f} us  perf {p50:6.1f} (x{hl/p50:.2f})  perf sleeping {p0:6.1f} (x{hl/p0:.2f})"
      f" | 8 MiB harness {hb:6.3f} Gbit/s  perf {pb:6.3f} (x{hb/pb:.2f}){t}")
EOF
}

# tcp4 NS0 NS1 ADDR: iperf3 -P 4 --bidir from NS0 to a server in NS1 at
# ADDR, 4 s; Gbit/s per direction (the mean of the two).
tcp4() {
    local ns0="$1" ns1="$2" addr="$3"
    (run_in "$ns1" iperf3 -s -1 -p 5299 >/dev/null 2>&1) &
    local pid=$!
    sleep 0.5
    (run_in "$ns0" iperf3 -c "$addr" -p 5299 -P 4 --bidir -t 4 -J 2>/dev/null) | python3 -c '
import json, sys
e = json.load(sys.stdin)["end"]
print(round((e["sum_sent"]["bits_per_second"] + e["sum_received_bidir_reverse"]["bits_per_second"]) / 2e9, 3))' || echo 0
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

EXTRA=""
for r in $(seq 1 "$rounds"); do
    if [ "$which" != fabric ]; then
        one loopback - 127.0.0.1 - 127.0.0.1 -
    fi
    if [ "$which" != loopback ]; then
        if [ "$r" = 1 ]; then
            METAROCE_FABRIC_PREFIX="$prefix" "$P" fabric up --spines 4 >/dev/null
        fi
        EXTRA="METAROCE_PATHS=16"
        METAROCE_FABRIC_PREFIX="$prefix" "$P" fabric loss 0 >/dev/null
        one fabric "$prefix-h1" 10.77.1.1 "$prefix-h2" 10.77.2.1 10.77.2.1:18515 --paths 16
        METAROCE_FABRIC_PREFIX="$prefix" "$P" fabric loss 1 >/dev/null
        one fabric-1% "$prefix-h1" 10.77.1.1 "$prefix-h2" 10.77.2.1 10.77.2.1:18515 --paths 16
        EXTRA=""
    fi
done
