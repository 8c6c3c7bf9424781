"""The one error of the node's index stores (primary index, MainIndex, sequences)."""

from __future__ import annotations

import grpc


class IndexBackendError(Exception):
    """The index storage failed: the request must fail (BACKEND_ERROR)."""

    grpc_status = grpc.StatusCode.UNAVAILABLE
