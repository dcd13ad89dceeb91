#!/usr/bin/env bash
# The store server's instructions per request, as issue 24's "Done means" measures them:
# `rdzv store serve` (one loop) runs under callgrind; after a warm-up run the counters
# are zeroed, then ADD round trips on one connection are measured (`bench store
# latency`), the counters zeroed again, then ADD+GET on 64 connections (`bench store
# throughput`). Each figure is the server's instructions (all threads) over the
# requests the bench completed; connection set-up is included, spread over thousands.
#
# Usage: benches/callgrind_store.sh [RDZV_BINARY] [io-uring|epoll]
# (SECS=N sets each measured run's seconds; build with `cargo build --release`.)
set -euo pipefail
rdzv=${1:-target/release/rdzv}
io=${2:-epoll}
secs=${SECS:-15}
dir=$(mktemp -d)
# Valgrind runs one thread at a time. An io_uring loop that sleeps in io_uring_enter
# before the main thread has printed its address can keep the main thread from running
# (seen about one start in two since the ring defers its task work): a start that prints
# nothing in 15 s is killed and tried again.
vg=
start() {
    rm -f "$dir"/cg.out*
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" \
        "$rdzv" store serve --host 127.0.0.1 --port 0 --threads 1 --spin-us 0 --io "$io" \
        >"$dir/serve.out" 2>"$dir/valgrind.log" &
    vg=$!
    for _ in $(seq 150); do
        grep -q "listening on" "$dir/serve.out" 2>/dev/null && return 0
        sleep 0.1
    done
    kill -9 "$vg" 2>/dev/null || true
    wait "$vg" 2>/dev/null || true
    return 1
}
# For the same reason the loop may not see SIGTERM until a completion comes: after 10 s
# it is killed (the dumps were written already).
stop() {
    if [ -n "$vg" ]; then
        kill "$vg" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$vg" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$vg" 2>/dev/null || true
        wait "$vg" 2>/dev/null || true
    fi
    if [ -n "${KEEP:-}" ]; then echo "dumps in $dir"; else rm -rf "$dir"; fi
}
trap stop EXIT
for attempt in 1 2 3 4 5 6; do
    start && break
    echo "the server printed no address in 15 s under valgrind (start $attempt); starting it again" >&2
done
addr=$(sed -n 's/^listening on //p' "$dir/serve.out" | head -1)
[ -n "$addr" ] || { cat "$dir/valgrind.log" >&2; exit 1; }
"$rdzv" bench store --addr "$addr" --json latency --secs 2 --warmup-secs 0 >/dev/null

# measure NAME FIELD ARGS...: zero, run the bench, dump; prints instructions per request.
measure() {
    local name=$1 field=$2
    shift 2
    callgrind_control -z "$vg" >/dev/null 2>&1
    local json
    json=$("$rdzv" bench store --addr "$addr" --json "$@" --warmup-secs 0)
    callgrind_control -d "$vg" >/dev/null 2>&1
    local dump
    dump=$(ls -t "$dir"/cg.out.* | head -1)
    local ir
    ir=$(sed -n 's/^summary: \([0-9]*\).*/\1/p; s/^totals: \([0-9]*\).*/\1/p' "$dump" | head -1)
    local ops
    ops=$(printf '%s\n' "$json" | python3 -c "
import json, sys
for line in sys.stdin:
    line = line.strip()
    if line.startswith('{'):
        r = json.loads(line)
        if '$field' in r:
            print(r['$field']); break")
    printf '%s: %s instructions / %s requests = %s per request\n' "$name" "$ir" "$ops" \
        "$(python3 -c "print(round($ir / $ops))")"
}
measure "ADD round trips, 1 connection" samples latency --secs "$secs"
measure "ADD+GET, 64 connections" ops throughput --conns 64 --secs "$secs"
