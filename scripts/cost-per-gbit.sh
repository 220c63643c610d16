#!/usr/bin/env bash
# cost-per-gbit.sh: where each side of the loopback throughput test spends
# its CPU, for metaroce (64 KiB WRITEs) and for raw UDP with GSO/GRO, in
# milliseconds of CPU per Gbit delivered, split into the kernel's payload
# copy, the rest of the kernel, user-space copies (memmove/memcpy) and the
# rest of user space.
#
# Raw UDP keeps both of its threads busy, so a side of metaroce that spends
# 1.25 times raw UDP's CPU per Gbit cannot carry more than 0.8 of its
# bytes on one core: this says which side, and in what, it spends more.
#
# It runs `loopback_baselines SECONDS 1 udp|metaroce` under
# `perf record -e cpu-clock` (no hardware counters needed), alternating the
# two, and sorts the samples by thread (the example names its threads
# `sender` and `receiver`). The machine is shared and noisy: compare the
# two tests within one run of this script, not across runs.

set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/cost-per-gbit.sh [options]

  --runs N        alternating pairs of runs (default 3)
  --seconds S     seconds per run (default 3)
  --freq HZ       sampling frequency (default 1000)
  -h, --help      this help

Needs perf (linux-perf) and permission to sample the process (root, or
kernel.perf_event_paranoid <= 1 for kernel samples).
EOF
}

runs=3
secs=3
freq=1000
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --seconds) secs="$2"; shift 2 ;;
        --freq) freq="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if ! command -v perf >/dev/null 2>&1; then
    echo "cost-per-gbit: perf is not installed (Debian: apt install linux-perf); nothing measured" >&2
    exit 1
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo build --release --example loopback_baselines >&2
target_dir="$(cargo metadata --format-version 1 --no-deps 2>/dev/null \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null \
    || echo "$root/target")"
bin="$target_dir/release/examples/loopback_baselines"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# One profiled run of `test`; prints a row per side:
# test side gbps total kernel_copy kernel_rest user_copy user_rest
profile() {
    local test="$1"
    local out gbps
    out="$(perf record -q -e cpu-clock -F "$freq" -o "$work/perf.data" \
        "$bin" "$secs" 1 "$test" 2>&1)"
    gbps="$(echo "$out" | sed -n 's/.* \([0-9.]*\) Gbit\/s.*/\1/p' | head -1)"
    if [ -z "$gbps" ]; then
        echo "cost-per-gbit: no throughput from the $test run:" >&2
        echo "$out" >&2
        exit 1
    fi
    perf script -i "$work/perf.data" -F comm,ip,sym 2>/dev/null | awk \
        -v test="$test" -v gbps="$gbps" -v secs="$secs" -v freq="$freq" '
        $1 != "sender" && $1 != "receiver" { next }
        {
            side = $1; n[side]++
            if ($3 ~ /^_copy_(from|to)_iter|^copy_user|^rep_movs/) kc[side]++
            else if ($2 ~ /^ffff/) kr[side]++
            else if ($3 ~ /memmove|memcpy/) uc[side]++
            else ur[side]++
        }
        END {
            # Samples are 1/freq s of CPU; per Gbit delivered, in ms.
            per = 1000 / freq / (gbps * secs)
            split("sender receiver", sides, " ")
            for (i = 1; i <= 2; i++) {
                s = sides[i]
                printf "%s %s %.2f %.1f %.1f %.1f %.1f %.1f\n", test, s, gbps,
                    n[s] * per, kc[s] * per, kr[s] * per, uc[s] * per, ur[s] * per
            }
        }'
}

rows="$work/rows"
: > "$rows"
for i in $(seq 1 "$runs"); do
    profile udp >> "$rows"
    profile metaroce >> "$rows"
done

printf '%-9s %-9s %7s | %6s %12s %12s %10s %10s\n' \
    test side Gbit/s total "kernel copy" "kernel rest" "user copy" "user rest"
printf '%s\n' "(ms of CPU per Gbit delivered; each run, then the medians)"
sort -k1,1 -k2,2 -s "$rows" | awk '{ printf "%-9s %-9s %7.2f | %6.1f %12.1f %12.1f %10.1f %10.1f\n", $1, $2, $3, $4, $5, $6, $7, $8 }'
echo
awk '
    { key = $1 " " $2; k[key] = 1; for (c = 3; c <= 8; c++) v[key, c, ++cnt[key, c]] = $c }
    function median(key, c,    m, i, j, t, a) {
        m = cnt[key, c]
        for (i = 1; i <= m; i++) a[i] = v[key, c, i]
        for (i = 2; i <= m; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
    }
    END {
        for (key in k) {
            split(key, p, " ")
            printf "median %-9s %-9s %7.2f | %6.1f %12.1f %12.1f %10.1f %10.1f\n", p[1], p[2],
                median(key, 3), median(key, 4), median(key, 5), median(key, 6), median(key, 7), median(key, 8)
            tot[key] = median(key, 4)
        }
        split("sender receiver", sides, " ")
        for (i = 1; i <= 2; i++) {
            if (tot["udp " sides[i]] > 0)
                printf "metaroce/raw UDP, %s CPU per Gbit: %.2f\n", sides[i], tot["metaroce " sides[i]] / tot["udp " sides[i]]
        }
    }' "$rows" | sort
