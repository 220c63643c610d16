#!/usr/bin/env bash
# The AF_XDP backend against io_uring across `metaroce fabric` (root).
#
#   scripts/xdp-compare.sh [ROUNDS [SECONDS]]     # default 3 rounds of 3 s runs
#   METAROCE_BIN=path/to/metaroce scripts/xdp-compare.sh
#
# Each round runs, for io_uring and then af_xdp on both sides (a `perf
# server --once` in h2, a client in h1, each under /usr/bin/time):
#   - 64 KiB WRITEs, 16 outstanding: Gbit/s, and Gbit/s per core (the
#     throughput over the CPU seconds both processes used per second);
#   - 64 B WRITEs, 128 outstanding: messages per second;
#   - 8 B SENDs, one outstanding: completion latency p50;
# on an unshaped fabric of 4 spines, every byte verified; then, on the
# same fabric with each spine limited to 200 Mbit/s (0.8 Gbit/s in all, far
# below what either backend moves unshaped), 64 KiB WRITEs with the drivers
# sleeping when idle (`--busy-poll 0`): CPU seconds per GB at a throughput
# the fabric, not the host, sets (the table shows how close the two come).
# Then the ceiling of each path with no protocol (`examples/xdp_pump.rs`,
# raw AF_XDP against a kernel UDP socket, one datagram per call, busy
# polling): datagrams per second at 64 and at 3798 bytes, 8 B round trips.
# Prints one JSON line per run and a table of medians and ratios.
set -euo pipefail

ROUNDS=${1:-3}
DUR=${2:-3}
B=${METAROCE_BIN:-target/release/metaroce}
X=${XDP_PUMP_BIN:-target/release/examples/xdp_pump}
export METAROCE_FABRIC_PREFIX=${METAROCE_FABRIC_PREFIX:-mrxdp}
P=$METAROCE_FABRIC_PREFIX
OUT=$(mktemp -d)
trap '"$B" fabric down >/dev/null 2>&1 || true; rm -rf "$OUT"' EXIT
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, XDP)" >&2; exit 1; }
[ -x "$B" ] || { echo "no $B: cargo build --release -p metaroce-cli" >&2; exit 1; }
[ -x "$X" ] || { echo "no $X: cargo build --release -p metaroce-io --example xdp_pump" >&2; exit 1; }

# pump BACKEND SIZE: one sink/source run, one JSON line.
pump() {
    ip netns exec "$P-h2" "$X" sink --backend "$1" --bind 10.77.2.1:9000 --seconds "$DUR" \
        2>/dev/null | sed "s/}$/, \"figure\": \"pump$2\"}/" &
    local sink=$!
    sleep 0.5
    ip netns exec "$P-h1" "$X" source --backend "$1" --bind 10.77.1.1:9001 \
        --to 10.77.2.1:9000 --size "$2" --seconds "$DUR" 2>/dev/null
    wait "$sink"
}

# ping BACKEND: 20,000 round trips of 8 bytes against an echo.
ping_pump() {
    ip netns exec "$P-h2" timeout 60 "$X" echo --backend "$1" --bind 10.77.2.1:9000 \
        --seconds 60 2>/dev/null &
    local echo=$!
    sleep 0.5
    ip netns exec "$P-h1" "$X" ping --backend "$1" --bind 10.77.1.1:9001 \
        --to 10.77.2.1:9000 2>/dev/null | sed 's/}$/, "figure": "pumpping"}/'
    kill "$echo" 2>/dev/null; wait "$echo" 2>/dev/null || true
}

# one BACKEND FIGURE PERF-CLIENT-ARGS...: one run, one JSON line.
one() {
    local be=$1 fig=$2; shift 2
    ip netns exec "$P-h2" /usr/bin/time -f "%U %S" -o "$OUT/s.time" \
        "$B" perf server --bind 10.77.2.1:18515 --once --backend "$be" "${EXTRA[@]}" \
        >"$OUT/s.out" 2>&1 &
    local srv=$!
    sleep 0.5
    ip netns exec "$P-h1" /usr/bin/time -f "%U %S" -o "$OUT/c.time" \
        "$B" perf client 10.77.2.1 --backend "$be" -D "$DUR" --json "${EXTRA[@]}" "$@" \
        >"$OUT/c.json" 2>"$OUT/c.err" || { cat "$OUT/c.err" >&2; }
    wait "$srv" || true
    python3 - "$be" "$fig" "$OUT" <<'EOF'
import json, sys
be, fig, out = sys.argv[1:4]
r = json.load(open(f"{out}/c.json"))
cpu = sum(sum(map(float, open(f"{out}/{s}.time").read().split()[-2:])) for s in "sc")
print(json.dumps({
    "backend": be, "figure": fig, "gbps": r["gbps"], "msg_rate_mps": r["msg_rate_mps"],
    "lat_p50_us": r["lat_p50_us"], "bytes": r["bytes"], "duration_s": r["duration_s"],
    "cpu_s": cpu, "corrupt": r["corrupt_bytes"], "mtu": r["mtu"],
    "xdp_mode": r.get("xdp_mode"),
}))
EOF
}

"$B" fabric up --spines 4 >/dev/null
for r in $(seq "$ROUNDS"); do
    for be in io_uring af_xdp; do
        EXTRA=()
        one "$be" write64k --op write -s 64K -t 16
        one "$be" write64 --op write -s 64 -t 128
        one "$be" send8 --op send -s 8 -t 1
    done
done | tee "$OUT/unshaped.jsonl"
for r in $(seq "$ROUNDS"); do
    for be in udp af_xdp; do
        pump "$be" 64
        pump "$be" 3798
        ping_pump "$be"
    done
done | tee "$OUT/pump.jsonl"
"$B" fabric down >/dev/null
"$B" fabric up --spines 4 --rate-mbit 200 >/dev/null
for r in $(seq "$ROUNDS"); do
    for be in io_uring af_xdp; do
        EXTRA=(--busy-poll 0)
        one "$be" equal --op write -s 64K -t 16
    done
done | tee "$OUT/shaped.jsonl"

python3 - "$OUT" "$DUR" <<'EOF'
import json, statistics as st, sys
out, dur = sys.argv[1], float(sys.argv[2])
rows = [json.loads(l) for f in ("unshaped", "shaped") for l in open(f"{out}/{f}.jsonl") if l.startswith("{")]
def vals(be, fig, f):
    return [f(r) for r in rows if r["backend"] == be and r["figure"] == fig]
def med(be, fig, f):
    v = vals(be, fig, f)
    return st.median(v) if v else float("nan")
figs = [
    ("64 KiB WRITEs, Gbit/s", "write64k", lambda r: r["gbps"]),
    ("64 KiB WRITEs, Gbit/s per core", "write64k", lambda r: r["gbps"] / (r["cpu_s"] / r["duration_s"])),
    ("64 B WRITEs, messages/s", "write64", lambda r: r["msg_rate_mps"] * 1e6),
    ("8 B SEND latency p50, us", "send8", lambda r: r["lat_p50_us"]),
    ("0.8 Gbit/s fabric: Gbit/s", "equal", lambda r: r["gbps"]),
    ("0.8 Gbit/s fabric: CPU s per GB", "equal", lambda r: r["cpu_s"] / (r["bytes"] / 1e9)),
]
print("| figure | io_uring | af_xdp | af_xdp / io_uring |")
print("|---|---|---|---|")
for name, fig, f in figs:
    a, b = med("io_uring", fig, f), med("af_xdp", fig, f)
    print(f"| {name} | {a:.4g} | {b:.4g} | {b / a:.2f} |")
bad = sum(r["corrupt"] for r in rows)
print(f"\ncorrupt bytes: {bad}; af_xdp mode: {sorted({r['xdp_mode'] for r in rows if r['xdp_mode']})}")
pumps = [json.loads(l) for l in open(f"{out}/pump.jsonl") if l.startswith("{")]
def pmed(be, fig, k):
    v = [r[k] for r in pumps if r["backend"] == be and r["figure"] == fig]
    return st.median(v) if v else float("nan")
print("\nNo protocol (examples/xdp_pump.rs):\n")
print("| figure | kernel UDP | af_xdp | af_xdp / UDP |")
print("|---|---|---|---|")
for name, fig, k in [("64 B datagrams/s", "pump64", "pps"), ("3798 B datagrams, Gbit/s", "pump3798", "gbps"),
                     ("8 B round trip p50, us", "pumpping", "p50_us")]:
    a, b = pmed("udp", fig, k), pmed("af_xdp", fig, k)
    print(f"| {name} | {a:.4g} | {b:.4g} | {b / a:.2f} |")
EOF
