#!/usr/bin/env bash
# Soak test (not part of CI): `metaroce perf` on loopback for 10 minutes with
# 1% of datagrams dropped, 1% duplicated and 1% reordered at each side's
# driver, once one way and once with --bidir. For each run it reports the
# process's RSS at minute 1 and at the end, the growth between them, and the
# verified and corrupt bytes; it fails if any byte was corrupt, the RSS grew
# by more than 5%, or perf failed.
#
#   scripts/soak.sh                      # release build, 600 s per run
#   SOAK_SECONDS=120 scripts/soak.sh     # shorter runs (RSS start at 1/10)
#   METAROCE_BIN=path/to/metaroce scripts/soak.sh   # a binary already built
#
# Extra arguments go to both `metaroce perf` runs (e.g. `--backend portable`).
set -euo pipefail

SECONDS_PER_RUN=${SOAK_SECONDS:-600}
FAULTS=(--loss 0.01 --duplicate 0.01 --reorder 0.01)
MAX_GROWTH_PCT=5

cd "$(dirname "$0")/.."
if [[ -z "${METAROCE_BIN:-}" ]]; then
    cargo build --release -q -p metaroce-cli
    target=${CARGO_TARGET_DIR:-target}
    METAROCE_BIN="$target/release/metaroce"
fi

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }

# The first sample at minute 1 (a tenth of a shorter run), the last 5 s
# before the end.
first_at=$((SECONDS_PER_RUN >= 600 ? 60 : SECONDS_PER_RUN / 10))
last_at=$((SECONDS_PER_RUN - 5))

failed=0
for mode in oneway bidir; do
    extra=()
    [[ $mode == bidir ]] && extra=(--bidir)
    out=$(mktemp)
    "$METAROCE_BIN" perf -D "$SECONDS_PER_RUN" "${FAULTS[@]}" "${extra[@]}" --json "$@" >"$out" &
    pid=$!
    sleep "$first_at"
    rss_start=$(rss_kib "$pid")
    sleep $((last_at - first_at))
    rss_end=$(rss_kib "$pid")
    status=0
    wait "$pid" || status=$?
    report=$(python3 - "$out" "$mode" "$rss_start" "$rss_end" "$status" "$MAX_GROWTH_PCT" <<'EOF'
import json, sys
path, mode, start, end, status, limit = sys.argv[1:]
start, end, status, limit = int(start), int(end), int(status), float(limit)
try:
    r = json.loads(open(path).read().strip().splitlines()[-1])
except Exception:
    r = {}
growth = 100.0 * (end - start) / start if start else float("nan")
verified = r.get("verified_bytes", 0)
corrupt = r.get("corrupt_bytes", -1)
ok = status == 0 and corrupt == 0 and verified > 0 and start > 0 and growth <= limit
print(f"{mode}: rss {start} KiB at start, {end} KiB at end ({growth:+.2f}%), "
      f"{verified} bytes verified, {corrupt} corrupt, {r.get('gbps', 0):.3f} Gbit/s, "
      f"{r.get('retransmits', 0)} retransmits, perf exit {status}: {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
    ) || failed=1
    echo "$report"
    rm -f "$out"
done
exit "$failed"
