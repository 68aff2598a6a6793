"""Decisions every rank takes together: a step that may fail on one rank ends with all ranks knowing it.

Without this, a rank that finds a damaged file exits alone and its peers die later in some unrelated
collective with a transport traceback ("Connection closed by peer" on gloo) or, on NCCL, hang until the
collective timeout. :func:`agree` runs a step on every rank, all-gathers each rank's outcome and raises the
same one-line :class:`AgreedFailure` on every rank when any of them failed::

    datasets = agree("building the datasets", lambda: dataset_builder(counts))

Rules that keep ranks in step:

* the only collectives inside an agreed step are other agreements (each one all-gather): a rank that
  fails early meets its peers' next agreement, and both sides read the same findings from it;
* an :class:`AgreedFailure` raised by an inner agreement passes through the outer ones without another
  collective: every rank already holds it.

A peer that disappears in the middle of training (its process killed, its node gone) is recognised from
the transport's error by :func:`is_lost_peer_error`; :func:`find_lost_ranks` then asks the rendezvous store
which ranks still answer, so the report (:func:`lost_peer_error`) names the lost rank and its node rather
than the transport.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, List, Optional, Sequence, TypeVar

import torch.distributed as dist

from domino.config import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors a step reports as a plain one-line finding; anything else is logged with its traceback first.
EXPECTED_ERRORS = (ConfigError, OSError)

#: How gloo reports a peer that went away (``third_party/gloo/gloo/transport/tcp/pair.cc`` in torch 2.13:
#: "Connection closed by peer", "Connection reset by peer", a write's "Broken pipe", a read's "Timed out")
#: and how torch's NCCL watchdog reports an aborted communicator (``ProcessGroupNCCL.cpp``).
LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                     "timed out", "NCCL communicator was aborted", "Connection refused")


class AgreedFailure(ConfigError):
    """A step failed on at least one rank; every rank raises this same error (one line, ranks named).

    A :class:`domino.config.ConfigError`, so the ``domino`` command prints it as one line with exit status 2.
    """


class PeerLostError(ConfigError):
    """A peer rank stopped answering during training (its process or node died).

    Printed as one line like every :class:`domino.config.ConfigError`, but with exit status 128: a restart
    can succeed, and the training operator's ``ExitCode`` policy retries exit codes 128-255 only.
    """

    exit_code = 128


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if isinstance(error, ConfigError) else f"{type(error).__name__}: {text}"


def _render(findings: Sequence[Optional[tuple]]) -> str:
    if len(findings) == 1:
        return findings[0][2]  # a lone process: the reason alone, as it would read without an agreement
    failed = [(rank, finding) for rank, finding in enumerate(findings) if finding is not None]
    return "; ".join(f"rank {rank} (node {host}) failed while {step}: {message}"
                     for rank, (step, host, message) in failed)


def agree(step: str, fn: Callable[[], T], group: Optional[dist.ProcessGroup] = None) -> T:
    """Runs ``fn`` on this rank; returns its result once every rank has succeeded (collective).

    Args:
        step: what the ranks are doing, for the message ("building the datasets").
        fn: the step; it may contain nested :func:`agree` calls, and collectives whose loss of a peer is
            re-raised as it is (the transport's error, for the caller's lost-peer report).
        group: the process group (spanning every rank) that carries the findings; default the world's. A
            CPU (gloo) group keeps the agreement off the device, so it costs no device synchronisation.

    Raises:
        AgreedFailure: on every rank when ``fn`` raised on any rank, naming each failed rank, its node,
            the step and the reason.
    """
    finding, result = None, None
    try:
        result = fn()
    except AgreedFailure:
        raise  # agreed by an inner step: the peers raise it too
    except EXPECTED_ERRORS as error:
        finding = (step, socket.gethostname(), _one_line(error))
    except Exception as error:  # a bug on one rank: stop every rank, keep the traceback in this rank's log
        if is_lost_peer_error(error):
            raise  # a collective inside the step lost its peer: no agreement can follow; the caller reports it
        logger.exception("unexpected error while %s", step)
        finding = (step, socket.gethostname(), _one_line(error))
    findings: List[Optional[tuple]] = [finding]
    if _world() > 1:
        findings = [None] * _world()
        dist.all_gather_object(findings, finding, group=group)
    if any(f is not None for f in findings):
        raise AgreedFailure(_render(findings))
    return result  # type: ignore[return-value]


def hosts() -> List[str]:
    """The node (host name) of every rank, by rank (collective; call once, while all ranks are alive)."""
    names = [socket.gethostname()]
    if _world() > 1:
        names = [None] * _world()  # type: ignore[list-item]
        dist.all_gather_object(names, socket.gethostname())
    return names


def is_lost_peer_error(error: BaseException) -> bool:
    """Whether ``error`` is the transport's report of a peer that went away (see LOST_PEER_MARKERS)."""
    return _world() > 1 and isinstance(error, RuntimeError) and any(m in str(error) for m in LOST_PEER_MARKERS)


def check_in() -> tuple:
    """Writes this rank's ``domino/alive/<restart>/<rank>`` in the default group's store; returns the store and
    the prefix. A rank that leaves the groups on purpose (an in-process restart) checks in first, so the peers
    its leaving disconnects find it alive without waiting (:func:`find_lost_ranks`)."""
    # torch.distributed keeps the rendezvous store of the default group here (torch 2.13
    # distributed_c10d.py ``_get_default_store``); there is no public accessor.
    store = dist.distributed_c10d._get_default_store()
    prefix = f"domino/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/{dist.get_rank()}", "1")
    return store, prefix


def find_lost_ranks(wait_s: float = 10.0) -> Optional[List[int]]:
    """The ranks that do not check in at the rendezvous store within ``wait_s`` (called after a lost peer).

    Every surviving rank writes ``domino/alive/<restart>/<rank>`` and waits for the others; a rank that
    never writes is lost. Returns None when the store itself is unreachable (it lives with the first node:
    torchrun's agent on node 0, or rank 0's process without torchrun), which means node 0 is gone.
    """
    try:
        store, prefix = check_in()
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(_world()) if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception as error:  # the store is gone with its host
        logger.debug("rendezvous store unreachable: %s", error)
        return None


def lost_peer_error(error: RuntimeError, hosts: Sequence[str], completed: int, resume_hint: str) -> PeerLostError:
    """The one-line report of a peer that went away during training: who (asking the rendezvous store which
    ranks still answer), the last iteration every rank ``completed``, and where a restart resumes.

    Args:
        error: the transport's error (:func:`is_lost_peer_error`).
        hosts: every rank's node, from :func:`hosts` while all ranks were alive.
        resume_hint: where a restart resumes, in words.
    """
    lost = find_lost_ranks()
    if lost is None:
        who = f"rank 0's node {hosts[0]} (it holds the rendezvous store)"
    elif lost:
        who = ", ".join(f"rank {r} (node {hosts[r]})" for r in lost)
    else:
        who = "a peer (every rank still answers the rendezvous store)"
    transport = next((m for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
                      if m in str(error)), " ".join(str(error).split())[:120])
    return PeerLostError(f"lost {who} during training after iteration {completed} (rank {dist.get_rank()} saw: "
                         f"{transport}); {resume_hint}")
