#!/bin/sh
# What end-to-end integrity and the authenticated mode cost on loopback
# (docs/BENCHMARKS.md, "Integrity and the authenticated mode"): rounds of
# `metaroce perf` (64 KiB WRITEs, every byte verified), each round running,
# one after the other, plain without CRC32C, plain with CRC32C (--crc on) and
# sealed with AES-128-GCM (--psk-file, a fresh random key). Prints Gbit/s and
# the process's CPU seconds (user + sys, both sides) per GB moved.
#
#   cargo build --release -p metaroce-cli
#   scripts/integrity-cost.sh [ROUNDS] [SECONDS]
set -eu
B=${B:-${CARGO_TARGET_DIR:-target}/release/metaroce}
ROUNDS=${1:-5}
DUR=${2:-2}
KEY=$(mktemp)
OUT=$(mktemp)
TIMES=$(mktemp)
trap 'rm -f "$KEY" "$OUT" "$TIMES"' EXIT
head -c 32 /dev/urandom > "$KEY"
for i in $(seq 1 "$ROUNDS"); do
  for mode in plain crc32c sealed; do
    case $mode in
      plain) args="--crc off" ;;
      crc32c) args="--crc on" ;;
      sealed) args="--psk-file $KEY" ;;
    esac
    # shellcheck disable=SC2086
    /usr/bin/time -f "%U %S" -o "$TIMES" "$B" perf --json -D "$DUR" $args > "$OUT"
    python3 - "$i" "$mode" "$OUT" "$TIMES" <<'PY'
import json, sys
v = json.load(open(sys.argv[3]))
u, s = map(float, open(sys.argv[4]).read().split()[-2:])
ok = v["verified_bytes"] == v["bytes"] and v["corrupt_bytes"] == 0
print(sys.argv[1], sys.argv[2], "gbps=%.3f" % v["gbps"],
      "cpu_s_per_GB=%.3f" % ((u + s) / (v["bytes"] / 1e9)),
      "integrity=%s" % v["integrity"], "security=%s" % v["security"],
      "mtu=%d" % v["mtu"], "verified" if ok else "NOT VERIFIED")
PY
  done
done
