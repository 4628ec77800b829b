"""torch.distributed for the lab's torch stand-in: the ranks of one host meet at the
init_method address (rank 0 listens there, as NCCL's TCP store does) and add up their
collectives' values when they synchronize; each all_reduce takes its time on the GPU
timeline at the bus bandwidth of the group's slowest GPU, and across hosts (not one MNNVL
domain) of the slowest host's HCAs (_hw.busbw). A host with the
`nccl_hang` fault never finishes a collective, as a real hung NCCL ring never does."""

import json
import socket
import threading
import time

from .. import _hw, cuda

_group = {}


class _Rendezvous(threading.Thread):
    """Rank 0's side: each round, every rank's values in, their sums out to all."""

    def __init__(self, server, world):
        super().__init__(daemon=True)
        self.server, self.world = server, world

    def run(self):
        conns = [self.server.accept()[0].makefile("rw") for _ in range(self.world)]
        while True:
            msgs = []
            for conn in conns:
                line = conn.readline()
                if not line:
                    return
                msgs.append(json.loads(line))
            sums = [sum(vals) for vals in zip(*(m["values"] for m in msgs), strict=True)]
            infos = [m["info"] for m in msgs if m.get("info")]
            for conn in conns:
                conn.write(json.dumps({"sums": sums, "infos": infos}) + "\n")
                conn.flush()


def _round(values, info=None):
    conn = _group["conn"]
    conn.write(json.dumps({"values": values, "info": info}) + "\n")
    conn.flush()
    line = conn.readline()
    if not line:
        raise RuntimeError("NCCL error: remote process exited or there was a network error")
    return json.loads(line)


def init_process_group(backend="nccl", init_method=None, rank=0, world_size=1, timeout=None):
    host, port = init_method.rsplit("//", 1)[1].rsplit(":", 1)
    if rank == 0:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, int(port)))
        server.listen(world_size)
        _Rendezvous(server, world_size).start()
    deadline = time.monotonic() + (timeout.total_seconds() if timeout else 1800)
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out initializing process group in store based "
                                   f"barrier on rank {rank}") from None
            time.sleep(0.05)
    sock.settimeout(None)
    _group.update(conn=sock.makefile("rw"), rank=rank, world=world_size, pending=[])
    _group["infos"] = _round([], _hw.rank_info(cuda._physical()))["infos"]


def get_rank():
    return _group["rank"]


def get_world_size():
    return _group["world"]


def all_reduce(tensor, op=None):
    if _hw.faults().get("nccl_hang"):
        _hw.TIMELINE.enqueue(float("inf"))
        return
    nbytes = tensor.numel() * tensor.dtype.itemsize
    world = _group["world"]
    seconds = nbytes * 2 * (world - 1) / world / (_hw.busbw(nbytes, _group["infos"]) * _hw.GB)
    _hw.TIMELINE.enqueue(seconds)
    _group["pending"].append(tensor)


def _settle():
    """The collectives enqueued since the last synchronize get every rank's sum."""
    pending = _group.get("pending")
    if pending:
        sums = _round([t.value for t in pending])["sums"]
        for tensor, total in zip(pending, sums, strict=True):
            tensor.value = total
        pending.clear()


def barrier(device_ids=None):
    cuda.synchronize()
    _round([])


def destroy_process_group():
    conn = _group.pop("conn", None)
    if conn:
        conn.close()
