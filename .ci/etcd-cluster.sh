#!/usr/bin/env bash
# A three-member etcd cluster on loopback, for the tests (tests/store_etcd.rs reads
# RDZV_ETCD_ENDPOINTS) and for trying rdzv's etcd:// store by hand.
#
#   .ci/etcd-cluster.sh start DIR   start members e0 e1 e2 with data and logs under DIR,
#                                   wait until every member is healthy, print the endpoints
#   .ci/etcd-cluster.sh stop DIR    kill the members (logs stay in DIR/e*.log)
#   .ci/etcd-cluster.sh endpoints   print the client endpoints (host:port,...)
#
# Ports: client 127.0.0.1:$BASE+0..2, peer 127.0.0.1:$BASE+10..12, with BASE from
# ETCD_CLUSTER_BASE_PORT (default 23790), away from a system etcd on 2379/2380.
set -euo pipefail

base="${ETCD_CLUSTER_BASE_PORT:-23790}"
members=(0 1 2)
client_port() { echo $((base + $1)); }
peer_port() { echo $((base + 10 + $1)); }

endpoints() {
    local list=()
    for i in "${members[@]}"; do list+=("127.0.0.1:$(client_port "$i")"); done
    (IFS=,; echo "${list[*]}")
}

start() {
    local dir="$1"
    mkdir -p "$dir"
    local initial=()
    for i in "${members[@]}"; do initial+=("e$i=http://127.0.0.1:$(peer_port "$i")"); done
    initial="$(IFS=,; echo "${initial[*]}")"
    for i in "${members[@]}"; do
        local client peer
        client="http://127.0.0.1:$(client_port "$i")"
        peer="http://127.0.0.1:$(peer_port "$i")"
        etcd --name "e$i" --data-dir "$dir/e$i.data" \
            --listen-client-urls "$client" --advertise-client-urls "$client" \
            --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
            --initial-cluster "$initial" --initial-cluster-state new \
            --initial-cluster-token rdzv-ci >"$dir/e$i.log" 2>&1 </dev/null &
        echo $! >"$dir/e$i.pid"
    done
    local eps deadline=$((SECONDS + 60))
    eps="$(endpoints)"
    until ETCDCTL_API=3 etcdctl --endpoints="$eps" --command-timeout=2s endpoint health >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            echo "etcd cluster in $dir did not become healthy in 60 s; logs:" >&2
            tail -n 20 "$dir"/e*.log >&2
            stop "$dir"
            exit 1
        fi
        sleep 0.5
    done
    echo "$eps"
}

stop() {
    local dir="$1" pids=() pid
    for pidfile in "$dir"/e*.pid; do
        [ -e "$pidfile" ] || continue
        pids+=("$(cat "$pidfile")")
        rm -f "$pidfile"
    done
    ((${#pids[@]})) || return 0
    kill "${pids[@]}" 2>/dev/null || true
    # The members are not this shell's children: poll until they are gone (a member
    # handing over leadership can take seconds), then, after 3 s, kill what is left.
    for _ in $(seq 30); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    rm -rf "$dir"/e*.data
}

case "${1:-}" in
    start) start "${2:?usage: $0 start DIR}" ;;
    stop) stop "${2:?usage: $0 stop DIR}" ;;
    endpoints) endpoints ;;
    *) echo "usage: $0 start DIR | stop DIR | endpoints" >&2; exit 2 ;;
esac
