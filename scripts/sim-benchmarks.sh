#!/usr/bin/env bash
# sim-benchmarks.sh: every simulator benchmark of docs/BENCHMARKS.md, run on
# one build, with the tables the document shows.
#
# The simulator is deterministic: the same build, command and seed give the
# same numbers on any host, loaded or not (only the wall time changes).
#
# usage: scripts/sim-benchmarks.sh [--out DIR] [--only GROUP[,GROUP...]] [--tail-paths N]
#   groups: sweep targets tail kernel hashing (default: all)
#   --tail-paths N: the tail group's connections spray over N paths (default: sim's)
#   METAROCE=path to a metaroce binary (else the release binary is built).
# Writes DIR/runs.jsonl (one report per run, with its group, case and command)
# and prints DIR/tables.md. About 7 minutes of one core.

set -euo pipefail
cd "$(dirname "$0")/.."

OUT=target/sim-benchmarks
ONLY=sweep,targets,tail,kernel,hashing
TAIL_PATHS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --tail-paths) TAIL_PATHS=(--paths "$2"); shift 2 ;;
    -h | --help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "sim-benchmarks: unknown option $1" >&2; exit 2 ;;
    esac
done
command -v python3 >/dev/null || { echo "sim-benchmarks: needs python3" >&2; exit 1; }

if [ -z "${METAROCE:-}" ]; then
    cargo build --release -q -p metaroce-cli
    METAROCE="${CARGO_TARGET_DIR:-target}/release/metaroce"
fi
mkdir -p "$OUT"
RUNS="$OUT/runs.jsonl"
: >"$RUNS"

want() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run GROUP CASE ARGS...: one `metaroce sim` (or a sweep), its reports tagged.
run() {
    local group=$1 case=$2
    shift 2
    echo "  $group / $case: metaroce sim $*" >&2
    "$METAROCE" sim "$@" --json | python3 -c '
import json, sys
group, case, cmd = sys.argv[1:4]
doc = json.load(sys.stdin)
for r in doc if isinstance(doc, list) else [doc]:
    r.pop("goodput_series_gbps", None)
    r.pop("links", None)
    r.update(group=group, case=case, command="metaroce sim " + cmd)
    print(json.dumps(r))
' "$group" "$case" "$*" >>"$RUNS"
}

if want sweep; then
    # 64 hosts, 8 spines, 100 Gbit/s, permutation of long-running flows, 10 ms.
    run sweep loss --transport all --sweep loss=0,0.001,0.01,0.05,0.1
fi

if want targets; then
    run targets incast --pattern incast:32 --chunk-bytes 65536 --outstanding 8
    run targets spine-fail --fail spine:3@5
    run targets spine-fail-64k --fail spine:3@5 --chunk-bytes 65536 --outstanding 8 --bin-us 20
    run targets gray-spine --fail spine:3@5=10
    run targets blackhole-spine --fail spine:3@5=blackhole
    run targets planes-1 --duration-ms 3 --chunk-bytes 65536 --verify-every 4 --planes 1 --paths 8 --outstanding 4
    run targets planes-4 --duration-ms 3 --chunk-bytes 65536 --verify-every 4 --planes 4 --paths 32 --outstanding 16
    run targets plane-fail --duration-ms 3 --chunk-bytes 65536 --verify-every 4 --planes 4 --paths 32 --outstanding 16 --fail plane:1@1
    run targets no-spraying --paths 1
    run targets no-hints --receiver-hints off
    run targets no-ecn --ecn off
fi

if want tail; then
    # 64 hosts, 8 spines: one round of a permutation of 32 MB flows.
    for loss in 0 0.01 0.1; do
        for seed in 1 2 3 4 5 6 7 8; do
            run tail "loss=$loss" --flow-bytes 32000000 --duration-ms 5.2 --loss "$loss" --seed "$seed" "${TAIL_PATHS[@]}"
        done
    done
fi

if want kernel; then
    # The shaped kernel fabric (scripts/compare-fabric.sh, `metaroce fabric up
    # --spines 4 --rate-mbit 200`): 4 spines at 200 Mbit/s behind tc tbf.
    K=(--hosts 2 --hosts-per-leaf 1 --spines 4 --link-gbps 10 --spine-shaper 0.2:100000:20ms
        --ecn off --pattern incast:1 --paths 16 --min-rto-us 2000 --ack-delay-us 20
        --initial-window 262144 --duration-ms 6000)
    run kernel lossless "${K[@]}"
    run kernel "1%" "${K[@]}" --loss 0.01
    for seed in 1 2 3; do run kernel "10%" "${K[@]}" --loss 0.1 --seed "$seed"; done
    for seed in 1 2 3; do run kernel stalls "${K[@]}" --host-stall 0.3:1000 --seed "$seed"; done
    run kernel "stalls, 10%" "${K[@]}" --host-stall 0.3:1000 --loss 0.1
    run kernel "1500 B, 1%" "${K[@]}" --mtu 1420 --loss 0.01
    run kernel "1500 B, 10%" "${K[@]}" --mtu 1420 --loss 0.1
    run kernel "gray spine" "${K[@]}" --fail spine:1@1000=0.02
    run kernel "blackhole spine" "${K[@]}" --fail spine:1@3000=blackhole
fi

if want hashing; then
    # Two hosts on two leaves, 4 spines: the spines are the bottleneck.
    for seed in 1 2 3 4 5 6 7 8; do
        run hashing "seed $seed" --hosts 2 --hosts-per-leaf 1 --spines 4 --paths 16 --duration-ms 20 --seed "$seed"
    done
fi

python3 - "$RUNS" >"$OUT/tables.md" <<'PY'
import json, statistics, sys
from collections import defaultdict

runs = [json.loads(l) for l in open(sys.argv[1])]
by = defaultdict(list)
for r in runs:
    by[(r["group"], r["case"])].append(r)

def f(x, d=2):
    return "–" if x is None else f"{x:.{d}f}"

def rtos(r):
    return r["transport_stats"]["timeouts"]

groups = {r["group"] for r in runs}
if "sweep" in groups:
    print("| transport | loss | goodput Gb/s | of line | vs. loss 0 | retx | max queue KB | bytes lost |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {}
    for r in by[("sweep", "loss")]:
        if r["loss"] == 0:
            base[r["transport"]] = r["goodput_gbps"]
        rel = r["goodput_gbps"] / base[r["transport"]] if base.get(r["transport"]) else None
        print(f"| {r['transport']} | {r['loss']:g} | {r['goodput_gbps']:.2f} | {r['goodput_fraction']:.3f} "
              f"| {f(rel, 3)} | {100 * r['retransmit_fraction']:.2f}% | {r['max_queue_bytes'] / 1e3:.0f} | {r['bytes_lost']} |")
    print()

if "targets" in groups:
    print("| case | command | goodput Gb/s | after the fault | recovery µs | RTOs | bytes lost | other |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for (g, c), rs in by.items():
        if g != "targets":
            continue
        r = rs[0]
        other = []
        if r.get("receiver_utilization") is not None:
            other.append(f"receiver link {r['receiver_utilization']:.3f}, queue {r['receiver_max_queue_bytes'] / 1e3:.0f} KB, "
                         f"convergence {f(r['convergence_us'], 0)} µs")
        if r.get("jain_fairness") is not None:
            other.append(f"Jain {r['jain_fairness']:.4f}")
        other.append(f"max queue {r['max_queue_bytes'] / 1e3:.0f} KB")
        print(f"| {c} | `{r['command']}` | {r['goodput_gbps']:.2f} | {f(r['goodput_after_fault_gbps'])} "
              f"| {f(r['recovery_us'], 0)} | {rtos(r)} | {r['bytes_lost']} | {'; '.join(other)} |")
    print()

if "tail" in groups:
    print("| loss | slowest flow Gb/s, seeds 1–8 | slowest, min / median | median flow (from fct p50), median | makespan µs, max | RTOs | bytes lost |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for (g, c), rs in by.items():
        if g != "tail":
            continue
        mins = [r["flow_rate_min_gbps"] or 0.0 for r in rs]
        p50 = [32e6 * 8 / (r["fct_p50_us"] * 1e3) for r in rs if r["fct_p50_us"]]
        mk = [r["makespan_us"] or float("inf") for r in rs]
        print(f"| {c.split('=')[1]} | {' '.join(f'{m:.1f}' for m in mins)} | {min(mins):.1f} / {statistics.median(mins):.1f} "
              f"| {statistics.median(p50):.1f} | {max(mk):.0f} | {sum(rtos(r) for r in rs)} | {sum(r['bytes_lost'] for r in rs)} |")
    print()

if "kernel" in groups:
    print("| case | seed | goodput / 0.8 Gbit/s | after the fault | retx | RTO fires | spurious losses | bytes lost |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (g, c), rs in by.items():
        if g != "kernel":
            continue
        for r in rs:
            spur = r.get("metaroce", {}).get("spurious_losses")
            after = r["goodput_after_fault_gbps"]
            print(f"| {c} | {r['seed']} | {r['goodput_gbps'] / 0.8:.3f} | {f(after / 0.8 if after is not None else None, 3)} "
                  f"| {100 * r['retransmit_fraction']:.2f}% | {r['metaroce']['rto_fires']} | {f(spur, 0)} | {r['bytes_lost']} |")
    print()

if "hashing" in groups:
    print("| seed | goodput Gb/s (line 100) | bytes lost |")
    print("|---:|---:|---:|")
    for (g, c), rs in by.items():
        if g == "hashing":
            print(f"| {rs[0]['seed']} | {rs[0]['goodput_gbps']:.2f} | {rs[0]['bytes_lost']} |")
    print()
PY
cat "$OUT/tables.md"
echo "sim-benchmarks: reports in $RUNS, tables in $OUT/tables.md" >&2
