#!/bin/sh
# Checks that systemd rates contrib/rdzv-store.service's exposure at 2.0 or less
# ("OK"): `systemd-analyze security --offline=yes`, which reads the unit file alone.
# Usage: contrib/check-hardening.sh [UNIT_FILE] [MAX]   (exits 1 above MAX, 2 when the
# rating cannot be read, 77 when systemd-analyze is missing: a skip, said on stderr).
set -eu
unit=${1:-"$(dirname "$0")/rdzv-store.service"}
max=${2:-2.0}
if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "check-hardening: skipped: systemd-analyze is not installed (apt-get install systemd)" >&2
    exit 77
fi
report=$(systemd-analyze security --offline=yes "$unit" 2>&1) || true
level=$(printf '%s\n' "$report" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
if [ -z "$level" ]; then
    printf '%s\n' "$report" >&2
    echo "check-hardening: no exposure level in systemd-analyze's report for $unit" >&2
    exit 2
fi
if awk -v level="$level" -v max="$max" 'BEGIN { exit !(level > max) }'; then
    printf '%s\n' "$report" | grep '✗' >&2 || true
    echo "check-hardening: $unit: exposure $level is above $max (the ✗ lines above say why)" >&2
    exit 1
fi
echo "check-hardening: $unit: exposure $level (at most $max)"
