# Starts PyTorch's own TCPStore server (argv[1]: use_libuv 1/0) on a free port, prints the
# port, and keeps it up for argv[2] seconds.
import sys, time, datetime
import torch.distributed as dist
libuv = sys.argv[1] == "1"
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
time.sleep(float(sys.argv[2]))
