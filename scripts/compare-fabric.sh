#!/usr/bin/env bash
# compare-fabric.sh: metaroce against TCP (BBR, CUBIC) and MPTCP on the real
# kernel fabric of `metaroce fabric` (network namespaces, ECMP spines rate
# limited with tc tbf, random loss with nftables), side by side.
#
# For each transport it measures goodput at 0%, 1% and 10% random loss on
# every spine, and through a spine cut in the middle of a run; it prints one
# table and writes it between the `compare-fabric` markers of
# docs/BENCHMARKS.md (unless --no-write). Needs root, nft, iperf3, python3;
# MPTCP needs mptcpize (Debian package mptcpize).
#
# Everything it starts (fabric namespaces PREFIX-*, iperf3, metaroce) is
# removed on exit, whatever happens.

set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/compare-fabric.sh [options]

  --spines N       spine links (default 4)
  --rate-mbit R    rate limit of each spine and direction, Mbit/s (default 200)
  --duration S     seconds per cell (default 6)
  --paths N        metaroce paths per connection (default 16)
  --mtu BYTES      MTU of every fabric link (default 9000, jumbo frames;
                   1500: standard frames, written between the
                   compare-fabric-mtu1500 markers of docs/BENCHMARKS.md)
  --prefix P       fabric namespace prefix (default mrcf)
  --quick          a short smoke run: 1.5 s cells, no 10% cells, no docs update
  --no-write       print the table only; leave docs/BENCHMARKS.md alone
  --check          check the prerequisites, print the plan, and exit
  -h, --help       this help

Environment: METAROCE=path to a metaroce binary (else the script builds
the release binary with cargo; CARGO_TARGET_DIR is honoured).
Cells: {metaroce, TCP BBR, TCP CUBIC, MPTCP} x {0%, 1%, 10% loss, spine cut}.
EOF
}

SPINES=4
RATE=200
DUR=6
PATHS=16
MTU=9000
PREFIX=mrcf
WRITE=1
QUICK=0
CHECK=0
while [ $# -gt 0 ]; do
    case "$1" in
    --spines) SPINES=$2; shift 2 ;;
    --rate-mbit) RATE=$2; shift 2 ;;
    --duration) DUR=$2; shift 2 ;;
    --paths) PATHS=$2; shift 2 ;;
    --mtu) MTU=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --quick) QUICK=1; WRITE=0; DUR=1.5; shift ;;
    --no-write) WRITE=0; shift ;;
    --check) CHECK=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "compare-fabric: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$SPINES$RATE$PATHS$MTU" in *[!0-9]*) echo "compare-fabric: --spines, --rate-mbit, --paths and --mtu take integers" >&2; exit 2 ;; esac
case "$DUR" in '' | *[!0-9.]*) echo "compare-fabric: --duration takes seconds" >&2; exit 2 ;; esac
if [ "$SPINES" -lt 2 ]; then
    echo "compare-fabric: a spine cut needs --spines 2 or more" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DOC=$ROOT/docs/BENCHMARKS.md
H1=$PREFIX-h1 H2=$PREFIX-h2 R1=$PREFIX-r1
IP1=10.77.1.1 IP2=10.77.2.1
PORT=5201 MRPORT=18515
# MPTCP: one extra client address per spine, pinned to it in router r1.
mp_addr() { echo "10.77.1.$((11 + $1))"; }

# ---------------------------------------------------------------- checks
missing=()
[ "$(id -u)" = 0 ] || missing+=("root (network namespaces, tc, nft: run with sudo)")
for t in ip tc nft iperf3 python3; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
done
HAVE_MPTCP=1
MPTCP_WHY=
if ! command -v mptcpize >/dev/null 2>&1; then
    HAVE_MPTCP=0
    MPTCP_WHY="mptcpize not installed (apt-get install mptcpize)"
elif [ ! -e /proc/sys/net/mptcp/enabled ]; then
    HAVE_MPTCP=0
    MPTCP_WHY="the kernel has no MPTCP (no /proc/sys/net/mptcp)"
fi
if [ "$CHECK" = 1 ]; then
    echo "compare-fabric plan: $SPINES spines x $RATE Mbit/s, MTU $MTU, ${DUR} s per cell, metaroce --paths $PATHS, prefix $PREFIX"
    echo "cells: metaroce, TCP BBR, TCP CUBIC, MPTCP x 0%, 1%, 10% loss, spine cut"
    [ "$HAVE_MPTCP" = 1 ] || echo "MPTCP would be skipped: $MPTCP_WHY"
    if [ ${#missing[@]} -gt 0 ]; then
        printf 'missing: %s\n' "${missing[@]}"
        exit 1
    fi
    echo "prerequisites: ok"
    exit 0
fi
if [ ${#missing[@]} -gt 0 ]; then
    printf 'compare-fabric: missing: %s\n' "${missing[@]}" >&2
    exit 1
fi

if [ -z "${METAROCE:-}" ]; then
    echo "compare-fabric: building the release binary" >&2
    (cd "$ROOT" && nice -n 10 cargo build --release -q -p metaroce-cli)
    METAROCE=${CARGO_TARGET_DIR:-$ROOT/target}/release/metaroce
fi
[ -x "$METAROCE" ] || { echo "compare-fabric: no metaroce binary at $METAROCE" >&2; exit 1; }

WORK=$(mktemp -d /tmp/compare-fabric.XXXXXX)
PIDS=()
fabric() { METAROCE_FABRIC_PREFIX=$PREFIX "$METAROCE" fabric "$@"; }
cleanup() {
    local rc=$?
    for p in "${PIDS[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
    fabric down >/dev/null 2>&1 || true
    if ip netns list | grep -q "^$PREFIX-"; then
        echo "compare-fabric: namespaces $PREFIX-* still there after down" >&2
    fi
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Starts a background command and remembers its pid for the cleanup.
spawn() {
    "$@" &
    PIDS+=("$!")
    LAST=$!
}

# ---------------------------------------------------------------- helper
PY=$WORK/helper.py
cat >"$PY" <<'PYEOF'
import json, os, subprocess, sys, time

def spine_tx(pid, n):
    """Bytes router r1 sent on each spine (towards h2) so far."""
    out = [0] * n
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.strip().partition(":")
            if name.startswith("sp") and name[2:].isdigit() and int(name[2:]) < n:
                out[int(name[2:])] = int(rest.split()[8])
    return out

def sample(pid, n, dur, cut, prefix, metaroce, rate, out):
    """Samples the spines every 10 ms for `dur` s; with `cut`, cuts the
    busiest spine at dur/2 and measures the move."""
    t0 = time.monotonic()
    ts, xs = [], []
    cut_at, cut_k = None, None
    while True:
        t = time.monotonic() - t0
        ts.append(t)
        xs.append(spine_tx(pid, n))
        if cut and cut_at is None and t >= dur / 2:
            # The spine that carried the most in the last 0.5 s.
            i = max(j for j in range(len(ts)) if ts[j] <= t - 0.5) if t > 0.5 else 0
            d = [xs[-1][k] - xs[i][k] for k in range(n)]
            cut_k = d.index(max(d))
            env = dict(os.environ, METAROCE_FABRIC_PREFIX=prefix)
            # The clock runs from the start of the cut command (taking both
            # ends of the link down takes a few ms of its own).
            cut_at = time.monotonic() - t0
            subprocess.run([metaroce, "fabric", "cut", str(cut_k)], env=env, check=True,
                           stdout=subprocess.DEVNULL)
        if t >= dur:
            break
        time.sleep(0.01)
    res = {"t": ts, "tx": xs, "cut_at": cut_at, "cut": cut_k}
    tot = [sum(x) for x in xs]
    res["spine_bytes"] = [xs[-1][k] - xs[0][k] for k in range(n)]
    if cut_at is not None:
        def rate_between(a, b, spines=range(n)):
            ia = min(range(len(ts)), key=lambda j: abs(ts[j] - a))
            ib = min(range(len(ts)), key=lambda j: abs(ts[j] - b))
            if ib <= ia:
                return 0.0
            by = sum(xs[ib][k] - xs[ia][k] for k in spines)
            return by * 8 / (ts[ib] - ts[ia]) / 1e6
        # (The run's last 0.3 s are left out: the client stops then.)
        end = ts[-1] - 0.3
        pre = rate_between(max(0.5, cut_at - 1.5), cut_at)
        post = rate_between(min(cut_at + 0.5, end - 0.2), end)
        cap = (n - 1) * rate
        want = 0.9 * min(pre, cap)
        rec = None
        ic = next(j for j in range(len(ts)) if ts[j] >= cut_at)
        # First 20 ms window after the cut at >= 90% of what the surviving
        # spines can carry of the traffic before it.
        for j in range(ic, len(ts) - 1):
            k = next((m for m in range(j + 1, len(ts)) if ts[m] - ts[j] >= 0.02), None)
            if k is None:
                break
            r = (tot[k] - tot[j]) * 8 / (ts[k] - ts[j]) / 1e6
            if r >= want:
                rec = (ts[k] - cut_at) * 1000
                break
        low = None
        for j in range(ic, len(ts)):
            k = next((m for m in range(j + 1, len(ts)) if ts[m] - ts[j] >= 0.05), None)
            if k is None or ts[k] > min(cut_at + 1.0, end):
                break
            r = (tot[k] - tot[j]) * 8 / (ts[k] - ts[j]) / 1e6
            low = r if low is None else min(low, r)
        res.update(pre_mbps=pre, post_mbps=post, want_mbps=want, recover_ms=rec,
                   low50_mbps=low)
    del res["t"], res["tx"]
    json.dump(res, open(out, "w"))

def cell(kind, run, samp, out, extra):
    """One cell's result from the client's JSON and the sampler's."""
    r = {"kind": kind}
    try:
        d = json.load(open(run))
    except Exception as e:
        r["error"] = f"no result ({e})"
        json.dump(r, open(out, "w"))
        return
    if kind == "metaroce":
        r.update(gbps=d["gbps"], retransmits=d["retransmits"], verified=d["verified_bytes"],
                 corrupt=d["corrupt_bytes"], sent=d["bytes"], backend=d["backend"],
                 spurious=sum(p.get("spurious", 0) for p in d["paths"]),
                 paths=len(d["paths"]))
        r["intact"] = d["corrupt_bytes"] == 0 and d["verified_bytes"] == d["bytes"]
    else:
        if "error" in d:
            r["error"] = d["error"]
        else:
            e = d["end"]
            r.update(gbps=e["sum_received"]["bits_per_second"] / 1e9,
                     retransmits=e["sum_sent"].get("retransmits", 0),
                     sent=e["sum_sent"]["bytes"], received=e["sum_received"]["bytes"])
    try:
        r["spines"] = json.load(open(samp))
    except Exception:
        pass
    if extra and os.path.exists(extra):
        r["subflows"] = open(extra).read().strip()
    json.dump(r, open(out, "w"))

def subflows(ss_out, peer):
    """TCP subflows (ESTAB sockets to the iperf3 port) that moved data."""
    n, busy = 0, 0
    lines = open(ss_out).read().split("\n")
    for i, l in enumerate(lines):
        if l.startswith("ESTAB") and f"{peer}:5201" in l:
            n += 1
            info = lines[i + 1] if i + 1 < len(lines) else ""
            for tok in info.split():
                if tok.startswith("bytes_acked:") and int(tok.split(":")[1]) > 1_000_000:
                    busy += 1
    return n, busy

def report(work, conds, meta):
    R = {}
    for f in os.listdir(work):
        if f.startswith("cell_") and f.endswith(".json"):
            _, t, c = f[:-5].split("_", 2)
            R[(t, c)] = json.load(open(os.path.join(work, f)))
    names = [("metaroce", f"metaroce ({meta['paths']} paths)"),
             ("bbr", "TCP BBR, 1 stream"), ("cubic", "TCP CUBIC, 1 stream"),
             ("mptcp", f"MPTCP, {meta['spines']} subflows (CUBIC)")]
    def g(t, c):
        r = R.get((t, c))
        return r.get("gbps") if r else None
    def fmt(v):
        return "—" if v is None else f"{v:.3f}"
    L = []
    L.append(f"Measured {meta['date']} with `{meta['cmd']}`: {meta['spines']} spines, each rate "
             f"limited to {meta['rate']} Mbit/s per direction (tc tbf, {meta['spines'] * meta['rate']} "
             f"Mbit/s in all), {meta['dur']} s per cell, random loss on every spine in both "
             f"directions (nftables), "
             + ("jumbo frames (MTU 9000)" if meta["mtu"] == 9000 else f"MTU {meta['mtu']}")
             + ("; metaroce with 8 KiB payloads (`perf --mtu 8256` on both sides)"
                if meta["mtu"] >= 8256 + 28 else "")
             + f". Host: {meta['host']}.")
    L.append("")
    L.append("Goodput in Gbit/s (metaroce: verified bytes of completed WRITEs / run time; "
             "iperf3: bytes received / time). *cut*: the busiest spine is cut "
             f"(`metaroce fabric cut K`) {meta['dur'] / 2:g} s into the run.")
    L.append("")
    L.append("| transport | 0% | 1% | 10% | cut |")
    L.append("|---|---:|---:|---:|---:|")
    for t, name in names:
        if (t, "0") not in R and t == "mptcp":
            L.append(f"| {name} | skipped: {meta.get('mptcp_why', '')} | | | |")
            continue
        cells = []
        for c in conds:
            r = R.get((t, c))
            if r is None:
                cells.append("—")
            elif "error" in r:
                cells.append("failed")
            else:
                cells.append(fmt(r["gbps"]))
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    m0, m1, m10 = g("metaroce", "0"), g("metaroce", "1"), g("metaroce", "10")
    tcp1 = [v for v in (g("bbr", "1"), g("cubic", "1")) if v]
    mp1 = g("mptcp", "1")
    def ratio(a, b):
        return a / b if a is not None and b else None
    rows = [
        ("metaroce 1% / 0%", ratio(m1, m0), 0.95, "≥ 0.95"),
        ("metaroce 10% / 0%", ratio(m10, m0), 0.85, "≥ 0.85"),
        ("metaroce / best single-stream TCP at 1%", ratio(m1, max(tcp1) if tcp1 else None), 3.0, "≥ 3×"),
        ("metaroce / MPTCP at 1%", ratio(m1, mp1), 1.2, "≥ 1.2×"),
    ]
    L.append("")
    L.append("| target | value | met? |")
    L.append("|---|---:|---|")
    for what, v, want, txt in rows:
        met = "n/a" if v is None else ("**met**" if v >= want else "**not met**")
        L.append(f"| {what} {txt} | {fmt(v)} | {met} |")
    mc = R.get(("metaroce", "cut"), {})
    sc = mc.get("spines", {})
    if mc and "error" not in mc:
        lost = mc["sent"] - mc["verified"]
        ok = mc["intact"]
        L.append(f"| cut: no byte lost or corrupted | {mc['verified']:,} of {mc['sent']:,} bytes "
                 f"verified, {mc['corrupt']} corrupt | {'**met**' if ok else '**not met**'} |")
        rec = sc.get("recover_ms")
        L.append(f"| cut: traffic moves within 50 ms | "
                 f"{'never (within the run)' if rec is None else f'{rec:.0f} ms'} | "
                 f"{'**met**' if rec is not None and rec <= 50 else '**not met**'} |")
    if m1 is not None and mp1:
        line = meta["spines"] * meta["rate"] / 1000
        L.append("")
        L.append(f"At 1% loss MPTCP delivers {mp1:.3f} Gbit/s, {100 * mp1 / line:.0f}% of the "
                 f"{line:g} Gbit/s the spines carry: 1.2× that is {1.2 * mp1:.3f} Gbit/s"
                 + (", more than the fabric can carry." if 1.2 * mp1 > line else "."))
    L.append("")
    L.append("Spine cut, measured on router r1's spine links every 10 ms (wire bytes, "
             "retransmissions included): rate before (last 1.5 s) and after (from 0.5 s after the "
             "cut to 0.3 s before the end), the lowest 50 ms rate in the second after the cut, and "
             "the time from the start of the cut command until the end of the first 20 ms window "
             "that carries 90% of what the surviving spines can take of the traffic before the cut "
             "(min(before, (N−1) × rate)). The measure cannot see less than about 20–30 ms "
             "(the window, the 10 ms sampling and the cut command itself).")
    L.append("")
    L.append("| transport | spine cut | before Mbit/s | after Mbit/s | lowest 50 ms | moved within | retransmits |")
    L.append("|---|---:|---:|---:|---:|---:|---:|")
    for t, name in names:
        r = R.get((t, "cut"))
        if not r or "error" in r or "spines" not in r:
            continue
        s = r["spines"]
        rec = s.get("recover_ms")
        L.append(f"| {name} | {s.get('cut')} | {s.get('pre_mbps', 0):.0f} | {s.get('post_mbps', 0):.0f} | "
                 f"{(s.get('low50_mbps') or 0):.0f} | {'not within the run' if rec is None else f'{rec:.0f} ms'} | "
                 f"{r.get('retransmits')} |")
    L.append("")
    L.append("How the traffic spread over the spines in the lossless cells "
             "(share of the bytes router r1 sent on each spine):")
    L.append("")
    L.append("| transport | " + " | ".join(f"sp{k}" for k in range(meta['spines'])) + " | notes |")
    L.append("|---|" + "---:|" * meta['spines'] + "---|")
    for t, name in names:
        r = R.get((t, "0"))
        if not r or "spines" not in r:
            continue
        b = r["spines"]["spine_bytes"]
        tot = sum(b) or 1
        note = []
        if t == "metaroce":
            note.append(f"{r.get('retransmits')} retransmits, {r.get('spurious')} spurious, "
                        f"{r.get('backend')} backend")
        else:
            note.append(f"{r.get('retransmits')} retransmits")
        if r.get("subflows"):
            note.append(r["subflows"])
        L.append(f"| {name} | " + " | ".join(f"{100 * x / tot:.0f}%" for x in b) + " | " + "; ".join(note) + " |")
    return "\n".join(L)

def write_doc(doc, text, mtu):
    s = open(doc).read()
    tag = "compare-fabric" if mtu == 9000 else f"compare-fabric-mtu{mtu}"
    a, b = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    i, j = s.index(a) + len(a), s.index(b)
    open(doc, "w").write(s[:i] + "\n" + text.rstrip() + "\n" + s[j:])

if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "sample":
        pid, n, dur, cut, prefix, mr, rate, out = sys.argv[2:]
        sample(int(pid), int(n), float(dur), cut == "1", prefix, mr, int(rate), out)
    elif cmd == "cell":
        cell(*sys.argv[2:6], sys.argv[6] if len(sys.argv) > 6 else None)
    elif cmd == "subflows":
        n, busy = subflows(sys.argv[2], sys.argv[3])
        print(f"{n} subflows established, {busy} carried data")
    elif cmd == "report":
        meta = json.loads(sys.argv[3])
        text = report(sys.argv[2], ["0", "1", "10", "cut"], meta)
        print(text)
        if len(sys.argv) > 4:
            write_doc(sys.argv[4], text, meta["mtu"])
PYEOF

# ---------------------------------------------------------------- fabric
echo "compare-fabric: fabric $PREFIX: $SPINES spines x $RATE Mbit/s" >&2
fabric up --spines "$SPINES" --rate-mbit "$RATE" --mtu "$MTU" >&2
# A process living in r1, so that its spine counters can be read cheaply.
spawn ip netns exec "$R1" sleep 100000
R1PID=$LAST

# MPTCP: enabled in both hosts, one extra client address per spine, each
# pinned to its spine in r1 by a source rule (ECMP would hash subflows onto
# spines at random); `subflow` endpoints open one subflow from each.
setup_mptcp() {
    local k a
    for ns in "$H1" "$H2"; do
        ip netns exec "$ns" sysctl -qw net.mptcp.enabled=1
        ip -n "$ns" mptcp endpoint flush
        ip -n "$ns" mptcp limits set subflows 8 add_addr_accepted 8
    done
    for ((k = 0; k < SPINES; k++)); do
        a=$(mp_addr "$k")
        ip -n "$H1" addr replace "$a/24" dev eth0
        [ "$k" = 0 ] || ip -n "$H1" mptcp endpoint add "$a" dev eth0 subflow
        ip -n "$R1" rule del from "$a" table $((100 + k)) 2>/dev/null || true
        ip -n "$R1" rule add from "$a" table $((100 + k))
    done
    pin_mptcp
}
# (Re)installs the per-spine routes (a cut takes them away with the link).
pin_mptcp() {
    local k
    for ((k = 0; k < SPINES; k++)); do
        ip -n "$R1" route replace 10.77.2.0/24 via "10.77.$((10 + k)).2" dev "sp$k" table $((100 + k)) 2>/dev/null || true
    done
}
if [ "$HAVE_MPTCP" = 1 ]; then
    setup_mptcp
fi

# metaroce's datagrams as large as the frames allow in whole 4 KiB pages, as
# TCP's segments fill the frames: 8 KiB payloads in jumbo frames (`perf`'s
# default, 4160, carries 4 KiB, RoCE's largest MTU); in smaller frames a
# client keeps within its route by itself.
MRMTU=()
[ "$MTU" -ge $((8256 + 28)) ] && MRMTU=(--mtu 8256)
spawn ip netns exec "$H2" "$METAROCE" perf server --bind "$IP2:$MRPORT" --paths "$PATHS" "${MRMTU[@]}" >"$WORK/server.log"
sleep 0.5

# run_cell TRANSPORT COND: one measurement.
run_cell() {
    local t=$1 c=$2 cut=0 out=$WORK/run_$1_$2.json samp=$WORK/samp_$1_$2.json extra=
    [ "$c" = cut ] && cut=1
    echo "compare-fabric: $t, $([ "$c" = cut ] && echo 'spine cut' || echo "$c% loss")" >&2
    local srv=
    case $t in
    bbr | cubic)
        spawn ip netns exec "$H2" iperf3 -s -1 -B "$IP2" -p "$PORT" >/dev/null
        srv=$LAST
        ;;
    mptcp)
        pin_mptcp
        spawn ip netns exec "$H2" mptcpize run iperf3 -s -1 -B "$IP2" -p "$PORT" >/dev/null
        srv=$LAST
        ;;
    esac
    [ -z "$srv" ] || sleep 0.3
    spawn python3 "$PY" sample "$R1PID" "$SPINES" "$DUR" "$cut" "$PREFIX" "$METAROCE" "$RATE" "$samp"
    local sampler=$LAST
    local rc=0
    case $t in
    metaroce)
        ip netns exec "$H1" timeout $((${DUR%.*} + 60)) "$METAROCE" perf client "$IP2:$MRPORT" \
            -D "$DUR" --paths "$PATHS" "${MRMTU[@]}" --json >"$out" 2>"$WORK/err" || rc=$?
        ;;
    bbr | cubic)
        ip netns exec "$H1" timeout $((${DUR%.*} + 30)) iperf3 -c "$IP2" -p "$PORT" -t "$DUR" \
            -C "$t" -J >"$out" 2>"$WORK/err" || rc=$?
        ;;
    mptcp)
        (sleep "$(python3 -c "print($DUR / 2 + 0.3)")" && ip netns exec "$H1" ss -tni >"$WORK/ss") &
        PIDS+=("$!")
        ip netns exec "$H1" timeout $((${DUR%.*} + 30)) mptcpize run iperf3 -c "$IP2" -p "$PORT" \
            -t "$DUR" -B "$(mp_addr 0)" -J >"$out" 2>"$WORK/err" || rc=$?
        if [ -s "$WORK/ss" ]; then
            python3 "$PY" subflows "$WORK/ss" "$IP2" >"$WORK/sub_$c"
            extra=$WORK/sub_$c
        fi
        ;;
    esac
    if [ "$rc" != 0 ]; then
        echo "compare-fabric: $t ($c) failed: $(head -c 300 "$WORK/err")" >&2
        [ "$t" != metaroce ] || echo "compare-fabric: the server said: $(tail -n 2 "$WORK/server.log")" >&2
    fi
    wait "$sampler" || true
    [ -z "$srv" ] || { kill "$srv" 2>/dev/null || true; wait "$srv" 2>/dev/null || true; }
    python3 "$PY" cell "$([ "$t" = metaroce ] && echo metaroce || echo iperf3)" "$out" "$samp" \
        "$WORK/cell_$1_$2.json" "$extra"
    if [ "$c" = cut ]; then
        local k
        k=$(python3 -c "import json; print(json.load(open('$samp')).get('cut'))" 2>/dev/null || echo)
        [ -z "$k" ] || [ "$k" = None ] || fabric heal "$k" >/dev/null
        sleep 0.5
    fi
}

TRANSPORTS=(metaroce bbr cubic)
[ "$HAVE_MPTCP" = 1 ] && TRANSPORTS+=(mptcp)
LOSSES=(0 1 10)
[ "$QUICK" = 1 ] && LOSSES=(0 1)
for c in "${LOSSES[@]}"; do
    fabric loss "$c" >/dev/null
    for t in "${TRANSPORTS[@]}"; do
        run_cell "$t" "$c"
    done
done
fabric loss 0 >/dev/null
for t in "${TRANSPORTS[@]}"; do
    run_cell "$t" cut
done

# ---------------------------------------------------------------- report
CMD="sudo scripts/compare-fabric.sh"
[ "$SPINES" = 4 ] || CMD+=" --spines $SPINES"
[ "$RATE" = 200 ] || CMD+=" --rate-mbit $RATE"
[ "$PATHS" = 16 ] || CMD+=" --paths $PATHS"
[ "$MTU" = 9000 ] || CMD+=" --mtu $MTU"
[ "$QUICK" = 1 ] && CMD+=" --quick" || { [ "$DUR" = 6 ] || CMD+=" --duration $DUR"; }
HOST="$(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), Linux $(uname -r), iperf3 $(iperf3 --version | head -1 | awk '{print $2}')"
META=$(python3 -c 'import json,sys; print(json.dumps(dict(date=sys.argv[1], cmd=sys.argv[2], spines=int(sys.argv[3]), rate=int(sys.argv[4]), dur=float(sys.argv[5]), paths=int(sys.argv[6]), host=sys.argv[7], mptcp_why=sys.argv[8], mtu=int(sys.argv[9]))))' \
    "$(date -u '+%Y-%m-%d %H:%M UTC')" "$CMD" "$SPINES" "$RATE" "$DUR" "$PATHS" "$HOST" "$MPTCP_WHY" "$MTU")
if [ "$WRITE" = 1 ]; then
    python3 "$PY" report "$WORK" "$META" "$DOC"
    echo "compare-fabric: written to $DOC" >&2
else
    python3 "$PY" report "$WORK" "$META"
fi
