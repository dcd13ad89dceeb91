#!/usr/bin/env python3
"""A logging TCP proxy for the TCPStore protocol: what does a PyTorch job send its store?

    store_trace_proxy.py LISTEN_PORT STORE_HOST:STORE_PORT LOG

Forwards every byte both ways unchanged and writes one line per client request to LOG:
`<connection> <QUERY> <keys…>` (values are left out). Used by `torchrun.sh` to record
which keys and operations torchrun's modes send to `rdzv store serve`; the summary it
prints (operations counted per query type, keys with numbers replaced by N) is what
docs/pytorch.md documents. Investigation tooling: nothing in CI runs it.
"""
import asyncio
import struct
import sys

NAMES = [
    "VALIDATE", "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT", "GETNUMKEYS",
    "DELETE_KEY", "APPEND", "MULTI_GET", "MULTI_SET", "CANCEL_WAIT", "PING",
    "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN", "LIST_KEYS", "BARRIER",
]
# The fields after the type byte: s = string (u64 length + bytes), u32, i64, n = a u64
# count of strings, m = a count of (key, value) pairs.
LAYOUT = {
    0: "u32", 1: "ss", 2: "sss", 3: "s", 4: "si", 5: "n", 6: "n", 7: "", 8: "s",
    9: "ss", 10: "n", 11: "m", 12: "", 13: "u32", 14: "ss", 15: "s", 16: "s", 17: "",
    18: "si",
}


class Incomplete(Exception):
    pass


def parse(buf, pos):
    """One request at `pos`: (name, keys, next position); raises Incomplete."""

    def need(n):
        if pos_[0] + n > len(buf):
            raise Incomplete
        chunk = buf[pos_[0]:pos_[0] + n]
        pos_[0] += n
        return chunk

    def string():
        (n,) = struct.unpack("<Q", need(8))
        return need(n)

    pos_ = [pos]
    query = need(1)[0]
    if query not in LAYOUT:
        return f"UNKNOWN({query})", [], len(buf)
    keys = []
    layout = LAYOUT[query]
    if layout == "u32":
        need(4)
    elif layout == "n":
        (n,) = struct.unpack("<Q", need(8))
        keys = [string() for _ in range(n)]
    elif layout == "m":
        (n,) = struct.unpack("<q", need(8))
        for _ in range(n):
            keys.append(string())
            string()
    elif layout:
        keys.append(string())
        for field in layout[1:]:
            if field == "s":
                string()
            else:
                need(8)
    return NAMES[query], [k.decode("utf-8", "replace") for k in keys], pos_[0]


async def main():
    listen_port, target, log_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    host, port = target.rsplit(":", 1)
    log = open(log_path, "a", buffering=1)
    counter = [0]

    async def pump(reader, writer, decode, conn):
        buf = b""
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
                if decode:
                    buf += data
                    pos = 0
                    while pos < len(buf):
                        try:
                            name, keys, pos = parse(buf, pos)
                        except Incomplete:
                            break
                        log.write(f"{conn} {name} {' '.join(keys)}\n")
                    buf = buf[pos:]
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer):
        counter[0] += 1
        conn = counter[0]
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(
            pump(client_reader, server_writer, True, conn),
            pump(server_reader, client_writer, False, conn),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    print("proxy ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
