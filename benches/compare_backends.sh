#!/usr/bin/env bash
# Throughput of rdzv's store server event loops under the same load, interleaved round by
# round: one io_uring loop (the default), two io_uring loops (`--threads 2`), and the
# epoll loops (`--io epoll`, one per CPU, and one). Prints the medians, with the CPU time
# the server and the load generator spend per operation (`--server-pid`).
#
# Usage: benches/compare_backends.sh [RDZV_BINARY] [ROUNDS] [SECS]
# (build first: cargo build --release)
set -euo pipefail
rdzv="${1:-target/release/rdzv}"
rounds="${2:-3}"
secs="${3:-2}"
out="$(mktemp)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -f "$out"; }
trap cleanup EXIT

start() { # $1 = label, the rest = serve arguments; prints "label port pid"
    local label="$1" fifo line
    shift
    fifo="$(mktemp -u)"
    mkfifo "$fifo"
    "$rdzv" store serve --host 127.0.0.1 --port 0 "$@" >"$fifo" 2>/dev/null &
    pids+=($!)
    read -r line <"$fifo"
    rm -f "$fifo"
    echo "$label ${line##*:} $!"
}

servers=("$(start io-uring --io io-uring)" "$(start io-uring-2 --io io-uring --threads 2)"
         "$(start epoll --io epoll)"
         "$(start epoll-1 --io epoll --threads 1)")
for round in $(seq "$rounds"); do
    for server in "${servers[@]}"; do
        read -r label port pid <<<"$server"
        echo "round $round: $label" >&2
        "$rdzv" bench store --addr "127.0.0.1:$port" --label "$label" --json \
            throughput --conns 1,64,512 --secs "$secs" --server-pid "$pid" >>"$out"
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
def med(rs, key):
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")
print(f"{'server':<10} {'conns':>5} {'ops/s':>9} {'p99 µs':>8} {'server CPU µs/op':>17} {'client CPU µs/op':>17}")
for label in ("io-uring", "io-uring-2", "epoll", "epoll-1"):
    for conns in (1, 64, 512):
        rs = [r for r in rows if r["target"] == label and r["conns"] == conns]
        if rs:
            print(f"{label:<10} {conns:>5} {med(rs, 'ops_per_s'):>9,.0f} {med(rs, 'p99_us'):>8,.0f}"
                  f" {med(rs, 'server_cpu_us_per_op'):>17.1f} {med(rs, 'client_cpu_us_per_op'):>17.1f}")
PY
