#!/usr/bin/env bash
# fabric-ab.sh: two metaroce builds on the kernel fabric of `metaroce fabric`,
# run by run alternated, so that a change to loss recovery or path choice is
# judged against its base on the same host in the same minutes (the shared
# development hosts move 2-3x within minutes; see docs/BENCHMARKS.md).
#
# Each run: a fresh `perf server --once` in PREFIX-h2, a `perf client` in
# PREFIX-h1 for the given seconds, every byte verified. Per run it prints the
# goodput as a share of the spines' capacity, RTO fires per 10,000 data
# packets and the share retransmitted; at the end the median of each build.
# Needs root and nft; removes the fabric on exit, whatever happens.

set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/fabric-ab.sh [options] BIN_A BIN_B

  BIN_A, BIN_B     metaroce binaries (e.g. target/release/metaroce and one
                   built from a `git worktree` of the base revision)
  --loss PCT       random loss on every spine, both directions (default 0)
  --runs N         runs of each build (default 5)
  --duration S     seconds per run (default 4)
  --paths N        paths per connection (default 16)
  --spines N       spines (default 4)
  --rate-mbit R    rate of each spine and direction (default 200; 0 = unshaped)
  --mtu M          MTU of every fabric link (default: the fabric's, jumbo)
  --prefix P       fabric namespace prefix (default mrab)
  --hog N          N busy loops at nice 19 beside the runs, a loaded host
                   on demand (default 0; the shared hosts' other guests
                   load them like this at times)
  -h, --help       this help
EOF
}

LOSS=0 RUNS=5 DUR=4 PATHS=16 SPINES=4 RATE=200 MTU= PREFIX=mrab HOG=0
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --loss) LOSS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --duration) DUR=$2; shift 2 ;;
    --paths) PATHS=$2; shift 2 ;;
    --spines) SPINES=$2; shift 2 ;;
    --rate-mbit) RATE=$2; shift 2 ;;
    --mtu) MTU=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --hog) HOG=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "fabric-ab: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) ARGS+=("$1"); shift ;;
    esac
done
if [ ${#ARGS[@]} -ne 2 ]; then usage >&2; exit 2; fi
A=${ARGS[0]} B=${ARGS[1]}
for bin in "$A" "$B"; do
    [ -x "$bin" ] || { echo "fabric-ab: $bin is not an executable" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "fabric-ab: needs root (network namespaces, tc, nft)" >&2; exit 2; }

H1=$PREFIX-h1 H2=$PREFIX-h2
OUT=$(mktemp -d)
HOGS=()
cleanup() {
    [ ${#HOGS[@]} -gt 0 ] && kill "${HOGS[@]}" 2>/dev/null || true
    ip netns pids "$H2" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns pids "$H1" 2>/dev/null | xargs -r kill 2>/dev/null || true
    "$A" fabric --prefix "$PREFIX" down >/dev/null 2>&1 || true
    rm -rf "$OUT"
}
trap cleanup EXIT INT TERM

UP=(fabric --prefix "$PREFIX" up --spines "$SPINES")
[ "$RATE" != 0 ] && UP+=(--rate-mbit "$RATE")
[ -n "$MTU" ] && UP+=(--mtu "$MTU")
"$A" "${UP[@]}" >/dev/null
"$A" fabric --prefix "$PREFIX" loss "$LOSS" >/dev/null
CAP=$(python3 -c "print($SPINES * $RATE / 1000)")

one_run() { # BIN LABEL INDEX
    local bin=$1 label=$2 i=$3 json=$OUT/$2-$3.json
    ip netns exec "$H2" "$bin" perf server --once --paths "$PATHS" >/dev/null 2>&1 &
    local srv=$!
    sleep 0.5
    if ! ip netns exec "$H1" "$bin" perf client 10.77.2.1 -D "$DUR" --paths "$PATHS" --json >"$json" 2>"$OUT/$label-$i.err"; then
        echo "$label run $i failed: $(tail -1 "$OUT/$label-$i.err")" >&2
        : >"$json"
    fi
    wait "$srv" 2>/dev/null || true
    python3 - "$json" "$label" "$i" "$CAP" <<'PY'
import json, sys
path, label, i, cap = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
try:
    r = json.load(open(path))
except Exception:
    print(f"{label} {i} failed"); sys.exit(0)
gbps = r["gbps"]
data = sum(p["packets"] for p in r.get("paths", []))
rto, retx = r["rto_fires"], r["retransmits"]
spurious = sum(p["spurious"] for p in r.get("paths", []))
share = f"{gbps / cap:.3f}" if cap > 0 else "-"
per10k = f"{rto * 1e4 / data:.2f}" if data else "-"
retxp = f"{100 * retx / data:.3f}" if data else "-"
print(f"{label} {i} gbps={gbps:.3f} of_capacity={share} rto_per_10k={per10k} "
      f"retx_pct={retxp} spurious={spurious} corrupt={r['corrupt_bytes']}")
PY
}

for _ in $(seq 1 "$HOG"); do
    nice -n 19 bash -c 'while :; do :; done' &
    HOGS+=($!)
done
for i in $(seq 1 "$RUNS"); do
    one_run "$A" A "$i" | tee -a "$OUT/results"
    one_run "$B" B "$i" | tee -a "$OUT/results"
done
if [ ${#HOGS[@]} -gt 0 ]; then
    kill "${HOGS[@]}" 2>/dev/null || true
    HOGS=()
fi

python3 - "$OUT/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 3 or f[2] == "failed":
        continue
    kv = dict(x.split("=") for x in f[2:])
    rows.setdefault(f[0], []).append(kv)
for label in ("A", "B"):
    r = rows.get(label, [])
    if not r:
        print(f"{label}: no successful run"); continue
    def med(key):
        v = [float(x[key]) for x in r if x.get(key, "-") != "-"]
        return f"{statistics.median(v):.3f}" if v else "-"
    print(f"{label}: {len(r)} runs, median gbps {med('gbps')}, of capacity {med('of_capacity')}, "
          f"RTO per 10k {med('rto_per_10k')}, retransmitted {med('retx_pct')}%")
PY
