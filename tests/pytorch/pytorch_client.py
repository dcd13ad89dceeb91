# PyTorch's own TCPStore client exercises every Store call against the server at
# argv[1]:argv[2] (an `rdzv store serve`).
# PyTorch's own TCPStore client against a server at argv[1]:argv[2].
import sys, datetime, threading
import torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
s = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
s.set("k", "v"); assert s.get("k") == b"v"
assert s.add("c", 5) == 5 and s.add("c", 2) == 7 and s.get("c") == b"7"
assert s.compare_set("cs", "", "new") == b"new"
assert s.compare_set("cs", "wrong", "x") == b"new"
assert s.compare_set("missing", "wrong_old_value", "x") == b"wrong_old_value"
assert s.check(["k", "c"]) and not s.check(["nope"])
s.append("ap", "po"); s.append("ap", "tato"); assert s.get("ap") == b"potato"
s.multi_set(["m1", "m2"], ["a", "b"]); assert s.multi_get(["m1", "m2"]) == [b"a", b"b"]
assert s.delete_key("k") and not s.delete_key("k")
n = s.num_keys()
s.queue_push("q", "1"); s.queue_push("q", "2"); assert s.queue_len("q") == 2
assert s.queue_pop("q") == b"1" and s.queue_pop("q", block=False) == b"2"
try:
    s.queue_pop("q", block=False); raise SystemExit("expected QueueEmptyError")
except dist.QueueEmptyError:
    pass
keys = sorted(s.list_keys()); print("list_keys", keys)
s.set_timeout(datetime.timedelta(milliseconds=100))
try:
    s.get("nonexistent key"); raise SystemExit("expected timeout")
except dist.DistStoreError as e:
    print("timeout text:", e)
s.set_timeout(datetime.timedelta(seconds=10))
s.set("after", "timeout"); assert s.get("after") == b"timeout"
# wait released by another client
def later():
    t = dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
    import time; time.sleep(0.2); t.set("late", "yes")
threading.Thread(target=later).start()
s.wait(["late"]); assert s.get("late") == b"yes"
# native barrier
ths = [threading.Thread(target=lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False).barrier("b", 3, datetime.timedelta(seconds=10))) for _ in range(2)]
[t.start() for t in ths]
s.barrier("b", 3, datetime.timedelta(seconds=10)); [t.join() for t in ths]
print("PYTORCH CLIENT OK against", host, port, "num_keys", n)
