"""Memory of a process pulling from JAX's transfer server, without pipejax: one process publishes a 16x64
fp32 array per uuid, this process pulls each one and waits for it either with ``block_until_ready``
(``--wait block``) or by polling ``jax.Array.is_ready()`` (``--wait poll``, what pipejax's transport does so
that every wait has a timeout); both processes' RSS is printed every 5,000 pulls, with the is_ready calls.

    python packages/pp-utils/benchmarks/transfer_pull_memory.py [--pulls 35001] [--wait block|poll]
    python packages/pp-utils/benchmarks/transfer_pull_memory.py --bare-is-ready 1000001   # no transfer at all
    python packages/pp-utils/benchmarks/transfer_pull_memory.py --bare-block 1000001      # the same, blocking

Measured with jaxlib 0.10.2 (2026-12-01), 35,001 pulls: ``--wait block`` 165.9 -> 166.7 MB; ``--wait poll``
(75.3M is_ready calls) 167.1 -> 500.6 MB. ``--bare-is-ready 1000001`` (1M calls on one ready local
array) grows 153.9 -> 223.0 MB: the leak is in ``is_ready`` itself, not in the transfer server;
``--bare-block 1000001`` grows as much (154.4 -> 223.5 MB): blocking is no way around it.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import transfer  # noqa: E402

# The publisher keeps at most WINDOW uuids ahead of the puller (it reads the puller's progress from a file).
WINDOW = 20
PUBLISHER = r"""
import sys, time
import jax, numpy as np
from jax.experimental import transfer
pulls, progress, window = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
print(server.address(), flush=True)
for uuid in range(pulls):
    server.await_pull(uuid, [jax.device_put(np.full((16, 64), uuid % 1000, np.float32))])
    while int(open(progress).read() or 0) < uuid - window:
        time.sleep(0.0005)
sys.stdin.read()
"""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pulls", type=int, default=40000)
    p.add_argument("--wait", choices=("block", "poll"), default="poll")
    p.add_argument("--bare-is-ready", type=int, default=0, help="only call is_ready() N times on one local array")
    p.add_argument("--bare-block", type=int, default=0, help="only call block_until_ready() N times on one array")
    args = p.parse_args()
    if args.bare_is_ready or args.bare_block:
        x = jax.device_put(np.ones((16, 64), np.float32))
        x.block_until_ready()
        name, call = ("is_ready", x.is_ready) if args.bare_is_ready else ("block_until_ready", x.block_until_ready)
        for i in range(args.bare_is_ready or args.bare_block):
            call()
            if i % 250000 == 0:
                print(f"{name} calls {i:8d}  rss {rss_mb(os.getpid()):7.1f} MB", flush=True)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".progress") as progress:
        progress.write("0")
        progress.flush()
        publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(args.pulls), progress.name, str(WINDOW)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            address = publisher.stdout.readline().strip()
            server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
            conn = server.connect(address)
            struct = jax.ShapeDtypeStruct((16, 64), np.float32,
                                          sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            start, polls = time.perf_counter(), 0
            for uuid in range(args.pulls):
                (got,) = conn.pull(uuid, [struct])
                if args.wait == "poll":
                    polls += 1
                    while not got.is_ready():
                        polls += 1
                else:
                    got.block_until_ready()
                if uuid % 10 == 0:
                    with open(progress.name, "w") as f:
                        f.write(str(uuid))
                if uuid % 5000 == 0:
                    gc.collect()
                    elapsed = time.perf_counter() - start
                    print(f"pull {uuid:6d}  {elapsed:6.1f} s  puller {rss_mb(os.getpid()):7.1f} MB  "
                          f"publisher {rss_mb(publisher.pid):7.1f} MB  is_ready calls {polls}", flush=True)
        finally:
            publisher.stdin.close()
            publisher.wait(timeout=30)


if __name__ == "__main__":
    main()
