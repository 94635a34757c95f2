"""The ``shared`` transport (``transport.py``): the head-parallel algorithm's messages through
buffers that every rank of the group maps, moved by plain copies.

Why: through NCCL a transfer is a kernel, which cannot start while a persistent attention kernel
holds every SM, so cutting a rank's heads into chunks did not overlap transfers with compute (our
reading, not profiled; the measurements are in docs/journal/results.md). A copy between two GPUs'
mapped buffers (``cudaMemcpyAsync`` over NVLink, which ``Tensor.copy_`` issues for contiguous
tensors of one dtype) runs on a copy engine and needs no SM. With it, chunk c+1's inputs arrive and
chunk c-1's results leave while chunk c computes. On CUDA the buffers are PyTorch's symmetric memory
(peer mappings only, never NVLink multicast); on CPU each rank's buffer is a shared-memory file
that every rank maps, so the tests run the same offsets, barriers and copies under gloo.

A rank's buffer holds two regions of P - 1 slots of ``slot`` bytes, one per peer (``_index``: the
peer's rank, less one above this rank's own):

* outbox (first region): peer d's slot holds what this rank sends rank d in a pass's input
  exchange, packed by this rank; rank d pulls it from there;
* inbox (second region): peer s's slot receives what rank s pushes here in the result exchange.

Within a slot, messages lie in the order both sides post them (the order in which the p2p
transport pairs an isend with its irecv), each at a 16-byte aligned offset. ``slot`` is computed
from the plan, the same on every rank, so no sizes travel.

One pass (:class:`Pass`): pack every chunk's inputs into the outbox (compute stream); barrier A;
pull all chunks' inputs (copy stream, an event per chunk, on which the compute of that chunk waits);
after each chunk's compute, pack its results locally and push them into the peers' inboxes (copy
stream); barrier B on the copy stream once every push is issued; the compute stream waits for it
and places the results. The next pass may reuse the buffer: a rank packs its outbox only after its
barrier B, which no rank passes before every pull of the pass is done; a peer pushes into a rank's
inbox only after barrier A, which that rank reaches only after placing the previous results.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile

import torch
import torch.distributed as dist

from . import comm
from .transport import ENV, Exchange, P2PExchange

ALIGN = 16    # bytes: every message starts at a multiple (any dtype's view; 16-byte copies)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def message_bytes(shape, dtype) -> int:
    """The room one message takes in a slot: its bytes, rounded up to the next message's alignment."""
    return aligned(_nbytes(shape, dtype))


class _CudaBuffers:
    """This rank's buffer in PyTorch's symmetric memory and views of the peers' (``get_buffer``)."""

    def __init__(self, group, device, nbytes: int):
        # Peer mappings are all this needs. NVLink multicast objects can take a shared host's GPUs
        # out of service, so symmetric memory must not create them (a stricter setting wins).
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        self.group = group
        try:
            symm_mem.enable_symm_mem_for_group(group.group_name)
            self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            self.handle = symm_mem.rendezvous(self.local, group)
        except RuntimeError as e:
            raise RuntimeError(f"{ENV}=shared needs every rank of the group on one host with peer access "
                               f"between its GPUs (PyTorch symmetric memory): {e}") from e
        self.nbytes = nbytes
        self._remote: dict[int, torch.Tensor] = {}
        self.copy_stream = torch.cuda.Stream(device)
        # A peer that never arrives makes the barrier kernel trap after the group's timeout (the
        # process then fails with a CUDA error) instead of spinning forever.
        self.timeout_ms = int(comm.group_timeout(group).total_seconds() * 1000)

    def remote(self, rank: int) -> torch.Tensor:
        if rank not in self._remote:
            self._remote[rank] = self.handle.get_buffer(rank, (self.nbytes,), torch.uint8)
        return self._remote[rank]

    def barrier(self, what: str) -> None:
        """On the current stream: returns at once; later work on the stream waits for every rank."""
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def copy_context(self):
        return torch.cuda.stream(self.copy_stream)

    def copy_after_compute(self) -> None:
        self.copy_stream.wait_stream(torch.cuda.current_stream())

    def compute_after_copy(self, event=None) -> None:
        if event is None:
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        else:
            torch.cuda.current_stream().wait_event(event)

    def mark(self):
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event


class _FileBuffers:
    """CPU stand-in: each rank's buffer a file in shared memory that every rank maps; copies happen
    at once and the barrier is the group's, bounded by its timeout like every wait on gloo."""

    def __init__(self, group, device, nbytes: int):
        self.group, self.rank, self.nbytes = group, dist.get_rank(group), nbytes
        tag = [secrets.token_hex(8)]
        with comm.guard(group, self.rank, "creating the shared buffers"):
            dist.broadcast_object_list(tag, group_src=0, group=group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = [os.path.join(folder, f"dash_fa3-cp-{tag[0]}-{r}") for r in range(dist.get_world_size(group))]
        with open(path[self.rank], "wb") as f:
            f.truncate(nbytes)
        self.barrier("creating the shared buffers")
        self.maps = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in path]
        self.barrier("mapping the shared buffers")
        os.unlink(path[self.rank])   # the mappings stay; nothing is left behind
        self.local = self.maps[self.rank]

    def remote(self, rank: int) -> torch.Tensor:
        return self.maps[rank]

    def barrier(self, what: str) -> None:
        work = dist.barrier(group=self.group, async_op=True)
        comm.wait_works([work], [("the barrier of every rank", None)], self.group, self.rank, what)

    def copy_context(self):
        return contextlib.nullcontext()

    def copy_after_compute(self) -> None:
        pass

    def compute_after_copy(self, event=None) -> None:
        pass

    def mark(self):
        return None


_buffers: dict[tuple[str, str], object] = {}


def buffers(group, device, nbytes: int):
    """The group's buffers on ``device``, at least ``nbytes`` each. Collective when it allocates:
    every rank asks for the same size at the same call, so all ranks take the same branch."""
    key = (group.group_name, str(device))
    have = _buffers.get(key)
    if have is not None and have.group is not group:
        # a new group under an old one's name (the old one destroyed): its peers are others
        del _buffers[key]
        have = None
    if have is not None and have.nbytes >= nbytes:
        return have
    if have is not None:
        # The old buffer goes only once no rank can still read or write it.
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        with comm.guard(group, dist.get_rank(group), "growing the shared buffers"):
            dist.barrier(group=group)
        del _buffers[key]
    cls = _CudaBuffers if torch.device(device).type == "cuda" else _FileBuffers
    _buffers[key] = cls(group, device, nbytes)
    return _buffers[key]


class Pass:
    """One pass's input exchange (``send_input`` / ``recv_input``, then :meth:`publish` and
    :meth:`pull`) and result exchange (``send_result`` / ``recv_result``, :meth:`push` per chunk,
    then :meth:`finish`)."""

    def __init__(self, group, rank: int, num_ranks: int, slot: int, device, what: str):
        self.rank, self.P, self.slot, self.what = rank, num_ranks, slot, what
        self.bufs = buffers(group, device, 2 * (num_ranks - 1) * slot)
        # running offsets within a slot, per peer: what this rank packed for it, pulls from it,
        # pushed to it, and receives from it
        self._packed, self._pulled, self._pushed, self._received = ([0] * num_ranks for _ in range(4))
        self._pending: list[tuple[int, int, torch.Tensor]] = []   # pulls not yet handed out
        self._outgoing: list[tuple[int, int, torch.Tensor]] = []  # pushes not yet issued
        self._keep: list[torch.Tensor] = []

    def _take(self, offsets: list[int], peer: int, shape, dtype) -> int:
        off = offsets[peer]
        offsets[peer] = off + message_bytes(shape, dtype)
        if offsets[peer] > self.slot:
            raise RuntimeError(f"dash_fa3.distributed ({self.what}): messages for rank {peer} exceed the "
                               f"{self.slot}-byte slot the plan sized (internal error)")
        return off

    @staticmethod
    def _index(owner: int, peer: int) -> int:
        """The slot of ``peer`` in ``owner``'s regions (owner has none for itself)."""
        return peer - (peer > owner)

    def _outbox(self, owner: int, peer: int, off: int) -> int:
        return self._index(owner, peer) * self.slot + off

    def _inbox(self, owner: int, peer: int, off: int) -> int:
        return (self.P - 1 + self._index(owner, peer)) * self.slot + off

    @staticmethod
    def _view(buf: torch.Tensor, start: int, shape, dtype) -> torch.Tensor:
        return buf[start:start + _nbytes(shape, dtype)].view(dtype).view(shape)

    # ---- inputs: packed here, pulled by the peer

    def send_input(self, peer: int, x: torch.Tensor) -> None:
        """Pack ``x`` (any strides) into this rank's outbox slot for ``peer`` (compute stream)."""
        off = self._take(self._packed, peer, x.shape, x.dtype)
        self._view(self.bufs.local, self._outbox(self.rank, peer, off), x.shape, x.dtype).copy_(x)

    def recv_input(self, peer: int, dst: torch.Tensor) -> None:
        """Register the copy of ``peer``'s next message for this rank into ``dst`` (contiguous); it
        is issued by the :meth:`pull` of the list :meth:`registered` returns."""
        self._pending.append((peer, self._take(self._pulled, peer, dst.shape, dst.dtype), dst))

    def registered(self) -> list[tuple[int, int, torch.Tensor]]:
        """The pulls registered since the last call (one chunk's), for :meth:`pull`."""
        out, self._pending = self._pending, []
        return out

    def publish(self) -> None:
        """Barrier A: every rank's outbox is packed (and its previous pass is over)."""
        self.bufs.barrier(f"{self.what}, outboxes packed")
        self.bufs.copy_after_compute()

    def pull(self, pulls):
        """Issue ``pulls`` (from :meth:`registered`) on the copy stream, after :meth:`publish`;
        returns the event the compute that reads them waits for (:meth:`ready`)."""
        with self.bufs.copy_context():
            for peer, off, dst in pulls:
                dst.copy_(self._view(self.bufs.remote(peer), self._outbox(peer, self.rank, off), dst.shape, dst.dtype))
        return self.bufs.mark()

    def ready(self, event) -> None:
        self.bufs.compute_after_copy(event)

    # ---- results: pushed here, placed by the peer

    def send_result(self, peer: int, y: torch.Tensor) -> None:
        """Make ``y`` contiguous (compute stream) and register its transfer into ``peer``'s inbox
        slot for this rank; :meth:`push` issues it."""
        y = y.contiguous()
        self._keep.append(y)   # read by the copy stream; freed after finish() orders that read
        self._outgoing.append((peer, self._take(self._pushed, peer, y.shape, y.dtype), y))

    def push(self) -> None:
        """Issue the registered pushes (one chunk's) on the copy stream, once the compute stream has
        made them."""
        self.bufs.copy_after_compute()
        with self.bufs.copy_context():
            for peer, off, y in self._outgoing:
                self._view(self.bufs.remote(peer), self._inbox(peer, self.rank, off), y.shape, y.dtype).copy_(y)
        self._outgoing = []

    def recv_result(self, peer: int, shape, dtype) -> torch.Tensor:
        """The view of this rank's inbox where ``peer``'s next message lands; valid after
        :meth:`finish`."""
        off = self._take(self._received, peer, shape, dtype)
        return self._view(self.bufs.local, self._inbox(self.rank, peer, off), shape, dtype)

    def finish(self) -> None:
        """Barrier B (copy stream): every rank's pushes have landed; the compute stream waits."""
        with self.bufs.copy_context():
            self.bufs.barrier(f"{self.what}, results pushed")
        self.bufs.compute_after_copy()
        self._keep = []

    def inputs(self) -> "_Side":
        """The input exchange as an :class:`~.transport.Exchange`: ``send`` packs into this rank's
        outbox, ``recv_into`` registers a pull (issued by :meth:`pull`)."""
        return _Side(send=self.send_input, recv_into=self.recv_input)

    def results(self) -> "_Side":
        """The result exchange as an :class:`~.transport.Exchange`: ``send`` registers a push into
        the peer's inbox (issued by :meth:`push`), ``recv_buffer`` is the view where a result lands."""
        return _Side(send=self.send_result, recv_buffer=self.recv_result)


class _Side(Exchange):
    """One direction of a :class:`Pass` through the :class:`~.transport.Exchange` interface."""

    def __init__(self, send, recv_into=None, recv_buffer=None):
        self.send = send
        if recv_into is not None:
            self.recv_into = recv_into
        if recv_buffer is not None:
            self.recv_buffer = recv_buffer


_slots: dict[tuple, int] = {}


def agreed_slot(group, rank: int, device, key: tuple, need: int) -> int:
    """The slot size of an exchange: the most bytes any rank sends any other in it. Every rank knows
    only its own messages, so the first exchange under ``key`` (a call's global signature, the same
    on every rank) takes the maximum over the group with one all-reduce; later ones reuse it."""
    full = (group.group_name, id(group), *key)
    if full not in _slots:
        t = torch.tensor([need], dtype=torch.int64,
                         device=device if comm.is_nccl(group) else "cpu")
        with comm.guard(group, rank, "sizing the shared buffers"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        _slots[full] = max(ALIGN, int(t.item()))
    return _slots[full]


class SharedExchange(Exchange):
    """One exchange of arbitrary messages through the shared buffers, with the p2p exchange's
    interface (``send``, ``recv_into``, ``recv_buffer``, then :meth:`post` and :meth:`wait`): the
    run plan and the superblock algorithm move their data this way.

    :meth:`post` packs every send into this rank's outbox (compute stream), passes barrier A and
    issues the pulls from the peers' outboxes on the copy stream; :meth:`wait` passes barrier B on
    the copy stream once the pulls are issued (no outbox is packed again before every peer has
    pulled from it) and orders the compute stream after it. ``key`` names the exchange for
    :func:`agreed_slot`."""

    def __init__(self, group, rank: int, what: str, device, key: tuple):
        self.group, self.rank, self.what, self.device, self.key = group, rank, what, device, key
        self.P = dist.get_world_size(group)
        self.sends: list[tuple[int, torch.Tensor]] = []
        self.recvs: list[tuple[int, torch.Tensor]] = []
        self._pass = None

    def send(self, peer: int, x: torch.Tensor) -> None:
        self.sends.append((peer, x))

    def recv_into(self, peer: int, dst: torch.Tensor) -> None:
        self.recvs.append((peer, dst))

    def recv_buffer(self, peer: int, shape, dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.recvs.append((peer, buf))
        return buf

    def _need(self) -> int:
        per_peer = [0] * self.P
        for peer, t in self.sends + self.recvs:
            per_peer[peer] += message_bytes(t.shape, t.dtype)
        return max(per_peer, default=0)

    def post(self) -> "SharedExchange":
        if self.P == 1:
            return self
        slot = agreed_slot(self.group, self.rank, self.device, (self.what, *self.key), self._need())
        p = self._pass = Pass(self.group, self.rank, self.P, slot, self.device, self.what)
        for peer, x in self.sends:
            p.send_input(peer, x)
        for peer, dst in self.recvs:
            p.recv_input(peer, dst)
        p.publish()
        self._event = p.pull(p.registered())
        return self

    def wait(self) -> None:
        if self._pass is None:
            return
        bufs = self._pass.bufs
        with bufs.copy_context():
            bufs.barrier(f"{self.what}, pulled")
        bufs.compute_after_copy()
        self._pass = None


def exchange(name: str, group, rank: int, what: str, device, key: tuple) -> Exchange:
    """A new exchange of the transport ``name`` (``transport.choose``): a :class:`SharedExchange`
    (``key``, the call's global signature, sizes its slots) or a ``P2PExchange``."""
    if name == "shared":
        return SharedExchange(group, rank, what, device, key)
    return P2PExchange(group, rank, what, device)
