"""How context parallelism communicates and fails: the package's errors, the group's timeout, and
posting and waiting for messages.

Every wait of every algorithm goes through :func:`wait_works`. On CPU (gloo) each wait is bounded
by the process group's timeout (``init_process_group(..., timeout=)`` / ``new_group(...,
timeout=)``): a peer that died fails the wait at once (connection closed), one that stalls at the
timeout, and either raises :class:`CommunicationError` (:class:`CommunicationTimeout` for the
latter) naming this rank, the place and the peer. On CUDA (NCCL) a wait orders the compute stream
after the transfer without blocking the host, so a stalled peer is left to the NCCL watchdog and
the group's timeout. A raw ``RuntimeError`` of a collective outside those waits is turned into the
same errors by :func:`guard`. After any of them the group is unusable: abort it or exit.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist


class CommunicationError(RuntimeError):
    """A peer failed (or its connection did) during distributed attention. The process group is
    unusable afterwards: abort it (or exit) rather than retry on it."""


class CommunicationTimeout(CommunicationError, TimeoutError):
    """A peer sent or received nothing within the process group's timeout."""


def group_timeout(group) -> datetime.timedelta:
    """The process group's timeout (what ``init_process_group``/``new_group`` got as ``timeout=``)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError):
        pass
    return dist.distributed_c10d.default_pg_timeout


def is_nccl(group) -> bool:
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):
        return False


_warmed: set[str] = set()


def ensure_communicator(group, device) -> None:
    """NCCL needs every rank of a group in its first collective; a point-to-point batch that
    leaves a rank out would hang there. One small all-reduce per group settles that."""
    if group.group_name in _warmed or torch.device(device).type != "cuda":
        return
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _warmed.add(group.group_name)


def _head(rank: int, where: str, what: str, peer) -> str:
    return f"dash_fa3.distributed: rank {rank} of the group, {where}: {what}" + ("" if peer is None else f" rank {peer}")


def _raise_from(e: BaseException, head: str, timeout: datetime.timedelta):
    limit = f"did not complete within the process group's timeout ({timeout.total_seconds():g} s)"
    if "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower():
        raise CommunicationTimeout(f"{head} {limit}: {e}") from e
    raise CommunicationError(f"{head} failed: {e}") from e


@contextlib.contextmanager
def guard(group, rank: int, where: str, what: str = "a collective"):
    """Turns the raw error of a torch.distributed call (a peer gone, a timeout) into
    :class:`CommunicationError` / :class:`CommunicationTimeout` naming ``where``."""
    try:
        yield
    except CommunicationError:
        raise
    except RuntimeError as e:   # gloo's and NCCL's errors (DistBackendError is one)
        _raise_from(e, _head(rank, where, what, None), group_timeout(group))


def post_p2p(sends, recvs, group, rank: int = 0, where: str = "posting messages", tag: int = 0) -> list:
    """Post (peer, tensor) sends and receives in one ``batch_isend_irecv``; return the works."""
    ops_ = [dist.P2POp(dist.isend, t, group=group, group_peer=p, tag=tag) for p, t in sends]
    ops_ += [dist.P2POp(dist.irecv, t, group=group, group_peer=p, tag=tag) for p, t in recvs]
    if not ops_:
        return []
    with guard(group, rank, where, "posting messages to the peers"):
        return dist.batch_isend_irecv(ops_)


def wait_works(works, peers, group, rank: int, where: str, timeout=None) -> None:
    """Wait for posted works; ``peers``: a ("send to" | "receive from", peer) per work (peer None: a
    collective, named by the first part alone). Bounded on gloo, stream-ordered on NCCL (see the
    module's docstring)."""
    if not works:
        return
    if is_nccl(group):
        with guard(group, rank, where):
            for w in works:
                w.wait()
        return
    timeout = timeout or group_timeout(group)
    for (what, peer), work in zip(peers, works):
        head = _head(rank, where, what, peer)
        try:
            ok = work.wait(timeout)
        except RuntimeError as e:
            _raise_from(e, head, timeout)
        if ok is False:
            raise CommunicationTimeout(f"{head} did not complete within the process group's timeout "
                                       f"({timeout.total_seconds():g} s)")
