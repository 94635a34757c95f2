"""Transports: how an algorithm's messages move, behind one interface.

Every algorithm describes its messages to an :class:`Exchange`: ``send(peer, tensor)``, and for
what arrives either ``recv_into(peer, destination)`` (the message fills a view in place) or
``recv_buffer(peer, shape, dtype)`` (a tensor to read once the exchange is over). Sender and
receiver post their messages for one peer in the same order, which is how the two sides pair up,
so no sizes or offsets travel.

* ``p2p`` (:class:`P2PExchange`): one ``batch_isend_irecv`` per exchange; NCCL on CUDA (its own
  stream, ordered by ``Work.wait()``, no host synchronisation), gloo on CPU (each wait bounded by
  the group's timeout). The fold schedules and the run plan use it; so does the head-parallel
  algorithm where the shared transport is not chosen.
* ``shared`` (``shared.py``): buffers every rank of the group maps, moved between by plain copies
  (copy engines on CUDA, shared-memory files on CPU); the head-parallel algorithm's input and result
  exchanges through ``shared.Pass``, the run plan's and the superblocks' through
  ``shared.SharedExchange``. It is also the one transport for ranks that share a GPU (NCCL refuses
  them).

:func:`choose` picks the head-parallel algorithm's transport: ``DASH_FA3_CP_TRANSPORT`` (the same on
every rank) when set, else ``shared`` for a CUDA group whose ranks are on one host, each on a GPU of
its own with peer access to the others' (two small all-gathers once per group), else ``p2p``.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from . import comm

ENV = "DASH_FA3_CP_TRANSPORT"
TRANSPORTS = ("p2p", "shared")


class Exchange:
    """The interface: one batch of messages to and from peers (see the module's docstring)."""

    def send(self, peer: int, x: torch.Tensor) -> None:
        raise NotImplementedError

    def recv_into(self, peer: int, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def recv_buffer(self, peer: int, shape, dtype) -> torch.Tensor:
        raise NotImplementedError


class P2PExchange(Exchange):
    """Sends and receives posted together (:meth:`post`) and waited for together (:meth:`wait`,
    bounded on gloo: :func:`~.comm.wait_works`). ``tag`` tells apart exchanges that may be in flight
    between the same ranks at once."""

    def __init__(self, group, rank: int, what: str, device, tag: int = 0):
        self.group, self.rank, self.what, self.device, self.tag = group, rank, what, device, tag
        self.sends: list[tuple[int, torch.Tensor]] = []
        self.recvs: list[tuple[int, torch.Tensor]] = []
        self.works = []

    def send(self, peer: int, x: torch.Tensor) -> None:
        self.sends.append((peer, x.contiguous()))

    def recv_into(self, peer: int, dst: torch.Tensor) -> None:
        self.recvs.append((peer, dst))

    def recv_buffer(self, peer: int, shape, dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.recvs.append((peer, buf))
        return buf

    def post(self) -> "P2PExchange":
        self.works = comm.post_p2p(self.sends, self.recvs, self.group, self.rank, self.what, self.tag)
        return self

    def wait(self) -> None:
        peers = [("send to", p) for p, _ in self.sends] + [("receive from", p) for p, _ in self.recvs]
        comm.wait_works(self.works, peers, self.group, self.rank, self.what)
        self.works = []


def choose(group=None, device=None) -> str:
    """The head-parallel transport: the one ``DASH_FA3_CP_TRANSPORT`` names (every rank of a group must
    name the same), else ``shared`` for a CUDA group that :func:`_maps_peers` accepts, else ``p2p``.
    Without a group and a device: the named one, else ``p2p``."""
    name = os.environ.get(ENV)
    if name is not None:
        if name not in TRANSPORTS:
            raise ValueError(f"{ENV}={name!r}: choose from {', '.join(TRANSPORTS)}")
        return name
    if group is None or device is None or torch.device(device).type != "cuda":
        return "p2p"
    return "shared" if _maps_peers(group, torch.device(device)) else "p2p"


_peer_verdicts: dict = {}


def _maps_peers(group, device: torch.device) -> bool:
    """Whether every rank of ``group`` is on this host, on a GPU of its own, with peer access to every
    other rank's GPU that it can see (collective, once per group: two small all-gathers). The same
    answer on every rank."""
    key = (group.group_name, id(group))
    if key in _peer_verdicts:
        return _peer_verdicts[key]
    index = device.index if device.index is not None else torch.cuda.current_device()
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(index).uuid))
    ranks = [None] * dist.get_world_size(group)
    rank = dist.get_rank(group)
    with comm.guard(group, rank, "choosing the transport"):
        dist.all_gather_object(ranks, mine, group=group)
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    ok = (all(host == mine[0] for host, _ in ranks) and len({uuid for _, uuid in ranks}) == len(ranks)
          and all(torch.cuda.can_device_access_peer(index, visible[uuid]) for _, uuid in ranks
                  if uuid != mine[1] and uuid in visible))
    verdicts = [None] * len(ranks)
    with comm.guard(group, rank, "choosing the transport"):
        dist.all_gather_object(verdicts, ok, group=group)
    _peer_verdicts[key] = all(verdicts)
    return _peer_verdicts[key]
