#!/usr/bin/env bash
# host-gaps.sh: how often this host takes a CPU away from a thread that
# never sleeps: the floor under any tail-latency figure measured here.
#
#   scripts/host-gaps.sh [SECONDS]
#
# One busy thread per CPU (pinned, nothing else of ours running) reads the
# monotonic clock in a tight loop for SECONDS (20) and counts the gaps
# between two reads longer than 50 µs, 100 µs, 250 µs and 1 ms, with the
# longest. On bare metal with an idle kernel these are near zero; on a
# shared virtual machine they are the hypervisor running other guests (the
# `steal` time of /proc/stat) and the host's interrupts. A transport round
# trip between two such threads is at least as long as any gap either of
# them sees, so a tail target below these gaps cannot be met on the host.
# Prints one JSON object per CPU.
set -euo pipefail

secs="${1:-20}"
ncpu="$(nproc)"
pids=()
for cpu in $(seq 0 $((ncpu - 1))); do
    taskset -c "$cpu" python3 - "$secs" "$cpu" <<'EOF' &
import json, sys, time
secs, cpu = float(sys.argv[1]), int(sys.argv[2])
limits = [50_000, 100_000, 250_000, 1_000_000]
counts = [0] * len(limits)
now = time.perf_counter_ns
end = now() + int(secs * 1e9)
last, reads, longest = now(), 0, 0
while last < end:
    t = now()
    gap = t - last
    if gap > limits[0]:
        for i, lim in enumerate(limits):
            if gap > lim:
                counts[i] += 1
        longest = max(longest, gap)
    last = t
    reads += 1
print(json.dumps({
    "cpu": cpu, "seconds": secs, "reads": reads,
    "gaps_over_50us": counts[0], "gaps_over_100us": counts[1],
    "gaps_over_250us": counts[2], "gaps_over_1ms": counts[3],
    "longest_ms": round(longest / 1e6, 3),
}), flush=True)
EOF
    pids+=($!)
done
steal0="$(awk '/^cpu /{print $9}' /proc/stat)"
wait "${pids[@]}"
steal1="$(awk '/^cpu /{print $9}' /proc/stat)"
hz="$(getconf CLK_TCK)"
python3 -c "import json; print(json.dumps({'steal_ms_all_cpus': round(($steal1 - $steal0) * 1000 / $hz, 1), 'seconds': $secs}))"
