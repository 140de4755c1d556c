"""Which rank was lost: each rank's heartbeat in the job's rendezvous store.

When a node dies mid-run, its peers learn it from a collective that fails ("connection
closed by peer" from gloo, an NCCL error) which names an address at best, never a rank,
and on a cluster the address is that of a proxy or of the dead node's NIC. Neither
torchrun nor DeepSpeed's launcher tells the surviving ranks who is gone. So every rank
of a multi-process run keeps a counter in the rendezvous store (the TCPStore at
``MASTER_ADDR:MASTER_PORT`` that every launcher already runs: rank 0's under DeepSpeed's
launcher and plain env:// rendezvous, the agent's under torchrun) and adds one to it every
``interval_s`` from a daemon thread. After a collective fails, ``lost_ranks`` reads the
counters twice, a few intervals apart: a rank whose counter stood still has stopped (its
process or its node is gone); if every counter moved, the peers are alive and one is hung
(stuck outside the collective); if the store cannot be reached at all, the node that hosts
it (rank 0's, or the first node's torchrun agent) is the one lost. Counters, not clocks, so
nodes need not agree on the time. Keys are namespaced by the launcher's run id and restart
count, so an elastic restart starts fresh counters.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as td


class Heartbeat:
    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        run = os.environ.get("TORCHELASTIC_RUN_ID", "") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"molds/heartbeat/{run}"
        # its own client connection: the process group's store is busy inside collectives
        self.store = self._client()
        self.store.set(f"{self.prefix}/who/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        self.failed: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="molds-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def _client(self, timeout_s: float = 30.0):
        """A client connection of its own (a loaded machine can take seconds to accept one)."""
        return td.TCPStore(self.host, self.port, is_master=False,
                           timeout=datetime.timedelta(seconds=max(timeout_s, 3 * self.interval_s)))

    def _beat(self) -> None:
        key = f"{self.prefix}/beat/{self.rank}"
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception as exc:  # the store's host is gone: said by lost_ranks, nothing to do here
                self.failed = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """End the beats and wait for the thread: a daemon thread still inside the store's
        C++ client while the interpreter shuts down aborts the process."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.interval_s)

    def lost_ranks(self, periods: float = 3.0) -> str:
        """One clause naming the ranks whose heartbeat stopped (with host and pid), or
        saying that every peer is alive (one is hung), or that the store is unreachable."""
        where = f"{self.host}:{self.port}"
        try:
            try:
                first = [self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.world_size)]
            except Exception:  # this client's connection may be what broke: one fresh connection
                self.store = self._client(timeout_s=5.0)
                first = [self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.world_size)]
            time.sleep(periods * self.interval_s)
            second = [self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.world_size)]
            stopped = [r for r in range(self.world_size) if r != self.rank and second[r] == first[r]]
            if not stopped:
                return ("every other rank's heartbeat is still beating: a peer is alive but stuck (hung) outside "
                        "this collective")
            names = []
            for r in stopped:
                try:
                    names.append(f"rank {r} ({self.store.get(f'{self.prefix}/who/{r}').decode()})")
                except Exception:
                    names.append(f"rank {r}")
            return (f"lost: {', '.join(names)} (heartbeat stopped: its process or its node is gone)")
        except Exception as exc:
            return (f"lost: the node that hosts the rendezvous store at {where} (rank 0's, or the first "
                    f"node's torchrun agent): the store is unreachable ({type(exc).__name__})")


def start_heartbeat(rank: int, world_size: int, interval_s: float = 1.0) -> Heartbeat | None:
    """A heartbeat for a multi-process run (None for one process, or when the store cannot
    be reached at start: said once, and failures then name no rank)."""
    if world_size <= 1 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return Heartbeat(rank, world_size, interval_s)
    except Exception as exc:  # never stop a run for its diagnostics
        print(f"[molds] warning: rank {rank}: no heartbeat in the rendezvous store ({exc}); a lost peer will "
              f"not be named", file=sys.stderr)
        return None
