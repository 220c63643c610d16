#!/usr/bin/env bash
# packet-cost.sh: the sans-IO core's instructions per data packet on each
# side of a bulk WRITE stream (64 KiB WRITEs, 16 outstanding, gathered GSO
# batches: the loopback benchmark's shape), counted by callgrind.
#
# Instruction counts do not move with the machine's load, so two builds can
# be compared exactly, which timing on a shared 2-core VM cannot do for a
# few percent. They are not cycles: a copy into cold memory costs more per
# instruction than header parsing does. Payload copies are therefore shown
# apart (memcpy/memmove, in instructions), not mixed into the protocol work.
#
# Sides, per data packet:
#   sender   = transmit (poll_transmit_gather) + ACK handling + posting WRs
#   receiver = receive (handle_datagram of data) + ACK building (poll_transmit)

set -euo pipefail

packets=100000
case "${1:-}" in
    -h|--help)
        echo "usage: scripts/packet-cost.sh [PACKETS]   (default 100000; needs valgrind)"
        exit 0 ;;
    "") ;;
    *) packets="$1" ;;
esac

if ! command -v valgrind >/dev/null 2>&1; then
    echo "packet-cost: valgrind is not installed (Debian: apt install valgrind); nothing counted" >&2
    exit 1
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo build --release -p metaroce-proto --example packet_cost >&2
target_dir="$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null \
    || echo "$root/target")"
bin="$target_dir/release/examples/packet_cost"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
valgrind --tool=callgrind --separate-callers=12 --callgrind-out-file="$work/cg.out" "$bin" "$packets" \
    > "$work/stdout" 2> "$work/stderr" || { cat "$work/stderr" >&2; exit 1; }

python3 - "$work/cg.out" "$work/stdout" <<'EOF'
import collections, re, sys

names, edges, self_cost = {}, collections.defaultdict(collections.Counter), collections.Counter()
cur = callee = None

def name(tok):
    m = re.match(r'\((\d+)\)(?: (.*))?', tok)
    if m.group(2):
        names[m.group(1)] = m.group(2)
    return names[m.group(1)]

lines = open(sys.argv[1]).read().split('\n')
i = 0
while i < len(lines):
    l = lines[i]
    if l.startswith('fn='):
        cur = name(l[3:])
    elif l.startswith('cfn='):
        callee = name(l[4:])
    elif l.startswith('calls='):
        edges[cur][callee] += int(lines[i + 1].split()[1])
        i += 1
    elif l and (l[0].isdigit() or l[0] in '+-*') and cur is not None:
        parts = l.split()
        if len(parts) >= 2:
            self_cost[cur] += int(parts[1])
    i += 1

def is_copy(f):
    return 'memcpy' in f or 'memmove' in f

words = open(sys.argv[2]).read().split()
out = dict(zip(words[0::2], words[1::2]))
packets = int(out['data_packets'])
sides = {
    'sender': ['sender_transmit', 'sender_receive', 'sender_post'],
    'receiver': ['receiver_receive', 'receiver_transmit'],
}
print(f"data packets {packets}, ACKs {out['ack_packets']}, WRITEs completed {out['writes_completed']}")
print(f"{'instructions per data packet':<40} {'protocol':>9} {'copies':>8}")
for side, fns in sides.items():
    tot_p = tot_c = 0
    for short in fns:
        # With --separate-callers each function is named with its callers
        # (f'caller'caller's caller...), so a copy knows which side ran it.
        tag = "'packet_cost::" + short + "'"
        incl = sum(c for g in edges for h, c in edges[g].items()
                   if h.endswith('packet_cost::' + short + "'packet_cost::main")
                   or (h.startswith('packet_cost::' + short + "'") and g.startswith('packet_cost::main')))
        copies = sum(c for g, c in self_cost.items() if is_copy(g.split("'")[0]) and tag in g)
        tot_p += incl - copies
        tot_c += copies
        print(f"  {side + ' ' + short:<38} {(incl - copies) / packets:9.0f} {copies / packets:8.0f}")
    print(f"{side + ' total':<40} {tot_p / packets:9.0f} {tot_c / packets:8.0f}")
EOF
