#!/usr/bin/env bash
# Throughput of rdzv's store server event loops under the same load, interleaved round by
# round: one io_uring loop (the default), two io_uring loops (`--threads 2`), and the
# epoll loops (`--io epoll`, one per CPU, and one). Prints the medians, with the CPU time
# the server and the load generator spend per operation (`--server-pid`).
#
# Usage: benches/compare_backends.sh [RDZV_BINARY] [ROUNDS] [SECS]
# (build first: cargo build --release)
#
# Before and after in one run: BASELINE=/path/to/an/older/rdzv (labelled $BASELINE_LABEL,
# default "base") adds that binary's four servers to every round, next to this one's. With
# PYTHON set to an interpreter that has torch, PyTorch's libuv TCPStore server joins the
# rounds too. The load generator is always RDZV_BINARY's `bench store`.
set -euo pipefail
rdzv="${1:-target/release/rdzv}"
rounds="${2:-3}"
secs="${3:-2}"
baseline="${BASELINE:-}"
base_label="${BASELINE_LABEL:-base}"
python="${PYTHON:-}"
out="$(mktemp)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -f "$out"; }
trap cleanup EXIT

start() { # $1 = label, $2 = binary, the rest = serve arguments; prints "label port pid"
    local label="$1" binary="$2" fifo line
    shift 2
    fifo="$(mktemp -u)"
    mkfifo "$fifo"
    "$binary" store serve --host 127.0.0.1 --port 0 "$@" >"$fifo" 2>/dev/null &
    pids+=($!)
    read -r line <"$fifo"
    rm -f "$fifo"
    echo "$label ${line##*:} $!"
}

start_pytorch() { # prints "pytorch port pid", or nothing without torch
    local fifo line
    if [ -z "$python" ] || ! "$python" -c "import torch" 2>/dev/null; then
        echo "no PyTorch (set PYTHON to an interpreter with torch): skipping its server" >&2
        return
    fi
    fifo="$(mktemp -u)"
    mkfifo "$fifo"
    "$python" -c '
import signal, sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
assert store.libuvBackend, "PyTorch did not start the libuv backend"
print(store.port, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
' >"$fifo" 2>/dev/null &
    pids+=($!)
    read -r line <"$fifo"
    rm -f "$fifo"
    echo "pytorch $line $!"
}

servers() { # $1 = label prefix, $2 = binary
    start "$1io-uring" "$2" --io io-uring
    start "$1io-uring-2" "$2" --io io-uring --threads 2
    start "$1epoll" "$2" --io epoll
    start "$1epoll-1" "$2" --io epoll --threads 1
}

mapfile -t servers < <(servers "" "$rdzv")
if [ -n "$baseline" ]; then
    mapfile -t -O "${#servers[@]}" servers < <(servers "$base_label:" "$baseline")
fi
pytorch="$(start_pytorch)"
if [ -n "$pytorch" ]; then servers+=("$pytorch"); fi
# The servers were started in subshells: their pids are in the lines.
for server in "${servers[@]}"; do pids+=("${server##* }"); done
for round in $(seq "$rounds"); do
    for server in "${servers[@]}"; do
        read -r label port pid <<<"$server"
        echo "round $round: $label" >&2
        "$rdzv" bench store --addr "127.0.0.1:$port" --label "$label" --json \
            throughput --conns 1,64,512 --secs "$secs" --server-pid "$pid" >>"$out"
    done
done
labels="$(printf '%s\n' "${servers[@]}" | cut -d' ' -f1 | paste -sd,)"
python3 - "$out" "$labels" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
def med(rs, key):
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")
print(f"{'server':<20} {'conns':>5} {'ops/s':>9} {'p99 µs':>8} {'server CPU µs/op':>17} {'client CPU µs/op':>17}")
for label in sys.argv[2].split(","):
    for conns in (1, 64, 512):
        rs = [r for r in rows if r["target"] == label and r["conns"] == conns]
        if rs:
            print(f"{label:<20} {conns:>5} {med(rs, 'ops_per_s'):>9,.0f} {med(rs, 'p99_us'):>8,.0f}"
                  f" {med(rs, 'server_cpu_us_per_op'):>17.1f} {med(rs, 'client_cpu_us_per_op'):>17.1f}")
PY
