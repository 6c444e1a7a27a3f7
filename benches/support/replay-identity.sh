#!/usr/bin/env bash
# Checks that two `cca` binaries make the same allocator decisions: every `cca replay TRACE
# --preset P --json` report, less its host-timing fields, must be identical for the shipped
# traces under `pytorch`, `default` and `lean-fast`. Used before each host-speed commit (#11).
#
#   benches/support/replay-identity.sh BASELINE_CCA NEW_CCA [TRACE...]
#
# Without traces: examples/traces/*, gpu/traces/*.pickle.gz and, where it exists,
# ../shared/traces/*.{pickle,csv.gz}. Exits non-zero at the first difference, printing it.
set -euo pipefail
base=$1 new=$2
shift 2
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ]; then
    set -- examples/traces/*.pickle.gz examples/traces/*.csv.gz gpu/traces/*.pickle.gz
    for t in ../shared/traces/*.pickle ../shared/traces/*.csv.gz; do
        [ -f "$t" ] && set -- "$@" "$t"
    done
fi
# The fields that are host time (they move from run to run): `ns_per_op*` (with
# `ns_per_op_timed`, the size of the timed sample) and `wall_*`.
drop='with_entries(select(.key | test("^(ns_per_op|wall_)") | not))'
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
for t in "$@"; do
    for p in pytorch default lean-fast; do
        "$base" replay "$t" --preset "$p" --json | jq -S "$drop" >"$tmp/a.json"
        "$new" replay "$t" --preset "$p" --json | jq -S "$drop" >"$tmp/b.json"
        if ! cmp -s "$tmp/a.json" "$tmp/b.json"; then
            echo "DIFFERENT: $t --preset $p"
            diff "$tmp/a.json" "$tmp/b.json" | head -40
            exit 1
        fi
        n=$((n + 1))
    done
done
echo "identical: $n reports ($# traces x 3 presets), timing fields aside"
