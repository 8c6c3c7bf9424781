"""One refusal type and one mapping from exceptions to gRPC status, for every service.

A :class:`Refusal` is a protocol or input rule saying no: it carries its
``grpc.StatusCode`` (docs/architecture.md, "Error conventions") and changes
nothing. Other exception types say which status they stand for with a
``grpc_status`` class attribute (an index backend error is UNAVAILABLE, a
fenced writer FAILED_PRECONDITION, ...), so that this module needs to know
none of them. :func:`status_of` is the single mapping both gRPC services use;
anything it does not recognise is a bug and answers INTERNAL (fail closed).

The client side of the same convention: :func:`reaching_node` and
:func:`reaching_trans_server` turn gRPC's transport
failure (a server that is down or restarting) into :class:`Unreachable`, which
declares its status the same way and says in our words which server did not
answer and when to retry.

Exception classes in every package are named by one rule (docs/architecture.md,
"Error conventions"): for what happened (``CatalogUnavailable``, ``NotFound``);
``Error`` only for a kind (``CatalogError``, ``ConfigError``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import NoReturn

import grpc

from retina_common.catalog import (
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    NotFound,
)
from retina_common.etcd import EtcdError

# In the details of a CommitGcRewrite refused ABORTED because a live read got rows of an
# old file from a write buffer (BUFFER_FETCH_HOLDS_FILE): nothing changed, the rewrite
# stays prepared, and a later commit of it goes through once the reader has ended.
HELD_BY_BUFFER_READ = "held by a write-buffer read"
# The same hold found only under the stream locks, after the commit had journaled: the
# rewrite was rolled back in place (nothing changed, the files stay as they were) and is
# gone; the job leaves the group for its next run, which prepares it again.
ROLLED_BACK_FOR_BUFFER_READ = "rolled back for a write-buffer read"
# In the details of a PrepareGcRewrite refused ABORTED because one of its files is the
# output of an earlier rewrite that both checkpoint slots do not hold yet (its journal entry
# is SWAPPED_NOT_CHECKPOINTED until the second checkpoint after its commit): nothing changed;
# a run after that checkpoint can merge it. The job's report counts these apart.
AWAITING_CHECKPOINT = "awaiting its second checkpoint"
# In the details of a MarkReady refused FAILED_PRECONDITION because a registered replay
# source was not replayed (a writer registered during the replay, say): nothing changed,
# the node stays AWAITING_REPLAY, and a driver replays again with every source.
SOURCES_NOT_REPLAYED = "EVERY_SOURCE_REPLAYED: replay sources not replayed"
# The first word of a FAILED_PRECONDITION refusing a read at a point whose history is no
# longer kept (docs/history.md): below the GC horizon, below a row group's folded base or
# the primary-index versions pruned, in the history a node's recovery rebuilt. The
# details name the earliest readable point as
# ``earliest_readable_ts=N earliest_readable_time_ms=M`` (M = 0: not known there);
# :func:`earliest_readable` reads them back. Never a partial, empty or wrong answer.
SNAPSHOT_EXPIRED = "snapshot_expired"
# The first word of a FAILED_PRECONDITION refusing an AS OF wall-clock time the
# TransServer's time map cannot place (it was down, or had crashed, then): pass a
# timestamp, or a time outside the gaps `retina-admin status` lists.
AS_OF_TIME_UNMAPPED = "as_of_time_unmapped"
# The first word of a FAILED_PRECONDITION refusing a change-feed cursor whose changes are
# no longer kept (docs/change-feed.md): the details name the earliest cursor the feed
# answers as ``earliest_cursor_ts=N``; :func:`earliest_cursor` reads it back. Never a
# silent gap, never a full scan in its place.
CHANGES_EXPIRED = "changes_expired"


class Refusal(Exception):
    """A refused call: ``code`` says what the caller should do (retry, stop, fix input)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    def __repr__(self) -> str:
        return f"Refusal({self.code.name}, {str(self)!r})"


# What gRPC's transport says when a call never reached a server, or lost it mid-call (the
# process died or is restarting): UNAVAILABLE with these words, never a refusal of ours.
_TRANSPORT_SIGNS = ("failed to connect", "Socket closed", "Connection reset")


def transport_lost(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE from gRPC's transport (no connection), not a server's own refusal."""
    if isinstance(exc, Unreachable):
        return True
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(
        sign in details for sign in _TRANSPORT_SIGNS)


class Unreachable(grpc.RpcError):
    """A query's call found no server at ``address``: our words instead of gRPC's
    ("failed to connect to all addresses; last error: ..."). It stays an RpcError whose
    code is its ``grpc_status`` (UNAVAILABLE), so every caller that retries or maps a
    status to an exit code treats it exactly as the transport error it replaces."""

    grpc_status = grpc.StatusCode.UNAVAILABLE

    def __init__(self, what: str, address: str, ready_when: str) -> None:
        super().__init__(f"{what} {address} is unreachable (it may be restarting); the "
                         f"query was not answered; retry when `retina-admin status` shows "
                         f"{ready_when}")
        self.address = address

    def code(self) -> grpc.StatusCode:
        return self.grpc_status

    def details(self) -> str:
        return str(self)


def reaching_node(address: str) -> AbstractContextManager[None]:
    """Calls to the Retina node at ``address`` inside the block (see :func:`_reaching`)."""
    return _reaching("node", address, "it READY")


def reaching_trans_server(address: str) -> AbstractContextManager[None]:
    """Calls to the TransServer at ``address`` inside the block."""
    return _reaching("TransServer", address, "it answering")


@contextmanager
def _reaching(what: str, address: str, ready_when: str) -> Iterator[None]:
    """A transport failure inside the block becomes Unreachable naming ``what`` and when
    to retry; any other status, a refusal, passes unchanged."""
    try:
        yield
    except Unreachable:
        raise
    except grpc.RpcError as exc:
        if transport_lost(exc):
            raise Unreachable(what, address, ready_when) from exc
        raise


def snapshot_expired(what: str, earliest_ts: int, earliest_time_ms: int = 0) -> Refusal:
    """The refusal of a read at a point whose history is gone (SNAPSHOT_EXPIRED)."""
    return Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                   f"{SNAPSHOT_EXPIRED}: {what}; earliest_readable_ts={earliest_ts} "
                   f"earliest_readable_time_ms={earliest_time_ms}")


_EARLIEST = re.compile(r"earliest_readable_ts=(\d+) earliest_readable_time_ms=(\d+)")


def earliest_readable(details: str) -> tuple[int, int] | None:
    """(earliest_readable_ts, earliest_readable_time_ms) of a SNAPSHOT_EXPIRED refusal's
    details; None for any other status text."""
    if not details.startswith(SNAPSHOT_EXPIRED):
        return None
    found = _EARLIEST.search(details)
    return (int(found.group(1)), int(found.group(2))) if found else None


def changes_expired(what: str, earliest_ts: int) -> Refusal:
    """The refusal of a change-feed cursor whose changes are gone (CHANGES_EXPIRED)."""
    return Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                   f"{CHANGES_EXPIRED}: {what}; earliest_cursor_ts={earliest_ts}")


_EARLIEST_CURSOR = re.compile(r"earliest_cursor_ts=(\d+)")


def earliest_cursor(details: str) -> int | None:
    """The earliest cursor a CHANGES_EXPIRED refusal's details name; None for any other
    status text."""
    if not details.startswith(CHANGES_EXPIRED):
        return None
    found = _EARLIEST_CURSOR.search(details)
    return int(found.group(1)) if found else None


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an exception answers with."""
    if isinstance(exc, Refusal):
        return exc.code, str(exc)
    declared = getattr(type(exc), "grpc_status", None)
    if isinstance(declared, grpc.StatusCode):
        return declared, str(exc)
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, CatalogUnavailable | CatalogOutcomeUnknown | EtcdError):
        # A dependency is down or its answer was lost: retry the same call.
        return grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, CatalogError):
        return grpc.StatusCode.INTERNAL, f"catalog: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """Answer the call with ``exc``'s status; never returns."""
    code, message = status_of(exc)
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises
