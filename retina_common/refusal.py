"""One refusal type and one mapping from exceptions to gRPC status, for every service.

A :class:`Refusal` is a protocol or input rule saying no: it carries its
``grpc.StatusCode`` (ARCHITECTURE.md, "Error conventions") and changes
nothing. Other exception types say which status they stand for with a
``grpc_status`` class attribute (an index backend error is UNAVAILABLE, a
fenced writer FAILED_PRECONDITION, ...), so that this module needs to know
none of them. :func:`status_of` is the single mapping both gRPC services use;
anything it does not recognise is a bug and answers INTERNAL (fail closed).
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from retina_common.catalog import (
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    NotFoundError,
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
# In the details of a MarkReady refused FAILED_PRECONDITION because a registered replay
# source was not replayed (a writer registered during the replay, say): nothing changed,
# the node stays AWAITING_REPLAY, and a driver replays again with every source.
SOURCES_NOT_REPLAYED = "EVERY_SOURCE_REPLAYED: replay sources not replayed"


class Refusal(Exception):
    """A refused call: ``code`` says what the caller should do (retry, stop, fix input)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    def __repr__(self) -> str:
        return f"Refusal({self.code.name}, {str(self)!r})"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an exception answers with."""
    if isinstance(exc, Refusal):
        return exc.code, str(exc)
    declared = getattr(type(exc), "grpc_status", None)
    if isinstance(declared, grpc.StatusCode):
        return declared, str(exc)
    if isinstance(exc, NotFoundError):
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
