#!/usr/bin/env bash
# PyTorch interop, both directions. Needs a Python with torch: PYTHON=/path/to/python.
#   1. PyTorch's TCPStore client against `rdzv store serve` (every Store call), on
#      `--io io-uring` and on `--io epoll`.
#   2. rdzv's CLI client against PyTorch's own server, libuv and legacy backends.
#   3. A 4-rank gloo init_process_group + all_reduce with TORCHELASTIC_USE_AGENT_STORE=True
#      whose store is `rdzv store serve`, on both event loops.
# Usage: PYTHON=... RDZV=target/release/rdzv tests/pytorch/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
RDZV="${RDZV:-$here/../../target/release/rdzv}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "skipped: $PYTHON cannot import torch"
    exit 0
fi
echo "torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), rdzv $RDZV"
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

for io in io-uring epoll; do
    port=$(free_port)
    "$RDZV" store serve --host 127.0.0.1 --port "$port" --io "$io" >/dev/null 2>&1 & pids+=($!)
    sleep 0.5
    echo "PyTorch's client against rdzv store serve --io $io:"
    "$PYTHON" "$here/pytorch_client.py" 127.0.0.1 "$port" 2>&1 | grep -v '^\[W'
done

for uv in 1 0; do
    out=$(mktemp)
    "$PYTHON" "$here/pytorch_server.py" "$uv" 60 >"$out" 2>/dev/null & pids+=($!)
    for _ in $(seq 600); do [ -s "$out" ] && break; sleep 0.1; done  # torch imports slowly on a busy host
    a="127.0.0.1:$(head -1 "$out")"
    "$RDZV" store --addr "$a" set k hello
    [ "$("$RDZV" store --addr "$a" get k)" = hello ]
    [ "$("$RDZV" store --addr "$a" add c 4)" = 4 ]
    [ "$("$RDZV" store --addr "$a" check k c)" = true ]
    [ "$("$RDZV" store --addr "$a" keys | sort | tr '\n' ' ')" = "c k " ]
    if "$RDZV" store --addr "$a" wait nope --timeout 0.2 2>/dev/null; then exit 1; fi
    [ "$("$RDZV" store --addr "$a" delete k)" = true ]
    echo "RDZV CLIENT OK against PyTorch's server (use_libuv=$uv)"
done

for io in io-uring epoll; do
    port=$(free_port)
    "$RDZV" store serve --host 127.0.0.1 --port "$port" --io "$io" >/dev/null 2>&1 & pids+=($!)
    sleep 0.5
    echo "gloo agent store on rdzv store serve --io $io:"
    "$PYTHON" "$here/gloo_agent_store.py" "$port" 2>&1 | grep -E 'OK|Error|error' | grep -v Warning
done
echo "pytorch interop: 5 passed, 0 failed"
