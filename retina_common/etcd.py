"""All etcd access of the project goes through this module (etcd v3 JSON gateway via etcd3gw).

Conventions (docs/architecture.md, "etcd keys"): leases and locks are never mutual exclusion;
writes that must not race are compare-and-swap on revisions. A failed write
is reported as one of two things:

* :class:`EtcdUnavailable` - the request could not be delivered; nothing changed;
* :class:`EtcdOutcomeUnknown` - the connection broke after the request may
  have been applied; callers re-read before deciding.

The watch is implemented here rather than with etcd3gw's watcher because that
one ends silently when its stream breaks; a gate built on it would keep
trusting a dead snapshot. :class:`PrefixWatch` reports the break.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_exc

from retina_common import failpoints as fp
from retina_common.config import EtcdConfig, split_host_port
from retina_common.log import get_logger

log = get_logger(component="etcd")


class EtcdError(Exception):
    """An etcd request failed."""


class EtcdUnavailable(EtcdError):
    """No endpoint could take the request; nothing changed."""


class EtcdOutcomeUnknown(EtcdError):
    """The request may or may not have been applied; re-read before deciding."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "PUT" | "DELETE"
    key: str
    value: bytes
    mod_revision: int


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


_CONNECT_FAILURES = ("connection refused", "failed to establish a new connection",
                     "name or service not known", "no route to host",
                     # a TLS handshake that failed: the request was never sent
                     "certificate verify failed", "wrong version number", "tlsv1 alert",
                     "sslv3 alert")


def _text(exc: Exception) -> str:
    """An etcd3gw error's message: it keeps it in ``detail_text``, str() is empty."""
    return str(getattr(exc, "detail_text", None) or exc)


def _never_sent(exc: Exception) -> bool:
    """True when the connection failed before the request could be sent."""
    text = _text(exc).lower()
    return any(marker in text for marker in _CONNECT_FAILURES)


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(item.get("key")).decode(),
        value=_unb64(item.get("value")),
        mod_revision=int(item.get("mod_revision", 0)),
        create_revision=int(item.get("create_revision", 0)),
        version=int(item.get("version", 0)),
        lease=int(item.get("lease", 0)),
    )


class EtcdStore:
    """A thread-safe client over one or more endpoints (``host:port``).

    Requests go to the current endpoint; an undeliverable request moves to
    the next endpoint and is retried once per endpoint (reads and
    compare-guarded writes are safe to retry; plain puts are idempotent).

    ``ca_file`` switches to https, verifying etcd's certificate against it;
    ``cert_file``/``key_file`` are the client certificate etcd may demand.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 5.0, *,
                 ca_file: str = "", cert_file: str = "", key_file: str = "") -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint configured")
        if bool(cert_file) != bool(key_file) or (cert_file and not ca_file):
            raise ValueError("an etcd client certificate needs its key and a CA file")
        self._endpoints = [split_host_port(e) for e in endpoints]
        self._timeout_s = timeout_s
        self._protocol = "https" if ca_file else "http"
        # Per request, not on the session: requests lets $REQUESTS_CA_BUNDLE override a
        # session's CA bundle, but not one given with the request.
        self._tls: dict[str, Any] = {}
        if ca_file:
            self._tls["verify"] = ca_file
        if cert_file:
            self._tls["cert"] = (cert_file, key_file)
        self._lock = threading.Lock()
        self._index = 0
        self._clients: dict[int, etcd3gw.Etcd3Client] = {}

    @classmethod
    def from_config(cls, config: EtcdConfig) -> EtcdStore:
        """The store a process's ``[etcd]`` section describes."""
        return cls(config.endpoints, config.timeout_s, ca_file=config.ca_file,
                   cert_file=config.cert_file, key_file=config.key_file)

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    def _client(self, index: int) -> etcd3gw.Etcd3Client:
        with self._lock:
            client = self._clients.get(index)
            if client is None:
                host, port = self._endpoints[index]
                client = etcd3gw.Etcd3Client(host=host, port=port, timeout=self._timeout_s,
                                             api_path="/v3/", protocol=self._protocol)
                self._clients[index] = client
            return client

    def _post(self, path: str, payload: dict[str, Any], *, write: bool) -> dict[str, Any]:
        last: Exception | None = None
        for attempt in range(len(self._endpoints)):
            index = (self._index + attempt) % len(self._endpoints)
            client = self._client(index)
            try:
                result = client.post(client.get_url(path), data=json.dumps(payload),
                                     **self._tls)
            except etcd_exc.ConnectionFailedError as exc:
                # A write whose connection broke after it was sent may have
                # landed; the caller learns which by re-reading.
                if write and not _never_sent(exc):
                    raise EtcdOutcomeUnknown(f"etcd {path}: {_text(exc)}") from exc
                last = exc
                continue
            except etcd_exc.ConnectionTimeoutError as exc:
                if write:
                    raise EtcdOutcomeUnknown(f"etcd {path} timed out: {_text(exc)}") from exc
                last = exc
                continue
            except etcd_exc.Etcd3Exception as exc:
                raise EtcdError(f"etcd {path}: {_text(exc)}") from exc
            if index != self._index:
                self._index = index
            return dict(result)
        raise EtcdUnavailable(f"etcd unreachable at {self._describe()}: "
                              f"{_text(last) if last else ''}")

    def _describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self._endpoints)

    # --- key/value -----------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        result = self._post("/kv/range", {"key": _b64(key)}, write=False)
        kvs = result.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision of the read."""
        result = self._post("/kv/range",
                            {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))},
                            write=False)
        revision = int(result.get("header", {}).get("revision", 0))
        return [_kv(item) for item in result.get("kvs") or []], revision

    def put(self, key: str, value: str | bytes, lease_id: int = 0) -> int:
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            payload["lease"] = lease_id
        result = self._post("/kv/put", payload, write=True)
        return int(result.get("header", {}).get("revision", 0))

    def delete(self, key: str) -> int:
        result = self._post("/kv/deleterange", {"key": _b64(key)}, write=True)
        return int(result.get("deleted", 0))

    def compare_and_put(self, key: str, value: str | bytes, expected_mod_revision: int,
                        lease_id: int = 0) -> int | None:
        """Put only if the key's mod revision is ``expected_mod_revision``.

        ``expected_mod_revision=0`` means "only if the key does not exist".
        Returns the key's new mod revision, or None (nothing changed) when the
        compare fails.
        """
        return self.compare_and_swap(
            compares=[(key, expected_mod_revision)],
            puts=[(key, value, lease_id)])

    def compare_and_swap(self, compares: Iterable[tuple[str, int]],
                         puts: Iterable[tuple[str, str | bytes, int]] = (),
                         deletes: Iterable[str] = ()) -> int | None:
        """One etcd transaction: if every key has the given mod revision (0 =
        absent), apply all puts and deletes and return the new store revision
        (the mod revision of every key written); otherwise change nothing and
        return None."""
        compare = []
        for key, revision in compares:
            if revision == 0:
                compare.append({"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                                "create_revision": "0"})
            else:
                compare.append({"key": _b64(key), "target": "MOD", "result": "EQUAL",
                                "mod_revision": str(revision)})
        success: list[dict[str, Any]] = []
        for key, value, lease_id in puts:
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease_id:
                put["lease"] = lease_id
            success.append({"request_put": put})
        success.extend({"request_delete_range": {"key": _b64(k)}} for k in deletes)
        result = self._post("/kv/txn", {"compare": compare, "success": success, "failure": []},
                            write=True)
        try:
            fp.ETCD_TXN_COMMIT_AFTER.hit()
        except fp.FailpointTriggered as exc:  # the answer lost after etcd applied it
            raise EtcdOutcomeUnknown(f"etcd /kv/txn: {exc}") from exc
        # The JSON gateway omits false booleans.
        if not result.get("succeeded", False):
            return None
        return int(result.get("header", {}).get("revision", 0))

    # --- leases --------------------------------------------------------------
    def grant_lease(self, ttl_s: int) -> int:
        result = self._post("/lease/grant", {"TTL": ttl_s}, write=True)
        return int(result["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns the remaining TTL (0 or less: the lease is gone)."""
        result = self._post("/lease/keepalive", {"ID": lease_id}, write=True)
        return int(result.get("result", {}).get("TTL", 0))

    def revoke_lease(self, lease_id: int) -> None:
        self._post("/lease/revoke", {"ID": lease_id}, write=True)

    # --- watch ---------------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int,
                     on_events: Callable[[list[WatchEvent]], None],
                     on_broken: Callable[[str], None]) -> PrefixWatch:
        """Stream events under ``prefix`` from ``start_revision`` on a thread.

        ``on_events`` receives each batch in revision order; ``on_broken`` is
        called exactly once when the stream ends for any reason other than
        :meth:`PrefixWatch.cancel`.
        """
        client = self._client(self._index)
        return PrefixWatch(client, prefix, start_revision, on_events, on_broken, self._tls)


class PrefixWatch:
    """A streaming watch on the v3 JSON gateway that reports when it breaks."""

    def __init__(self, client: etcd3gw.Etcd3Client, prefix: str, start_revision: int,
                 on_events: Callable[[list[WatchEvent]], None],
                 on_broken: Callable[[str], None],
                 tls: dict[str, Any] | None = None) -> None:
        self._cancelled = threading.Event()
        self._tls = tls or {}  # the store's CA bundle and client certificate
        self._response: requests.Response | None = None
        self._on_events = on_events
        self._on_broken = on_broken
        request = {"create_request": {
            "key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
            "start_revision": str(start_revision),
        }}
        self._url = client.get_url("/watch")
        self._session = requests.Session()
        self._request = request
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch{prefix}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        reason = "watch stream ended"
        try:
            # No read timeout: a quiet prefix is normal. A hung stream is
            # caught by the consumers' own staleness rules.
            response = self._session.post(self._url, json=self._request, stream=True,
                                          timeout=(5, None), **self._tls)
            self._response = response
            if response.status_code != 200:
                reason = f"watch refused: HTTP {response.status_code}"
                return
            # chunk_size=None: lines as the data arrives (requests allows it; its
            # annotations do not say so).
            for line in response.iter_lines(chunk_size=None):  # type: ignore[call-overload]
                if self._cancelled.is_set():
                    return
                if not line.strip():
                    continue
                message = json.loads(line)
                if "error" in message:
                    reason = f"watch error: {message['error']}"
                    return
                result = message.get("result", {})
                if result.get("canceled"):
                    reason = f"watch cancelled by etcd: {result.get('cancel_reason', '')}"
                    return
                events = [
                    WatchEvent(kind=e.get("type", "PUT"),
                               key=_unb64(e["kv"].get("key")).decode(),
                               value=_unb64(e["kv"].get("value")),
                               mod_revision=int(e["kv"].get("mod_revision", 0)))
                    for e in result.get("events") or []
                ]
                if events:
                    self._on_events(events)
        except Exception as exc:
            reason = f"watch failed: {exc.__class__.__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                self._session.close()
            if not self._cancelled.is_set():
                log.warning("etcd_watch_broken", reason=reason)
                self._on_broken(reason)

    def cancel(self) -> None:
        """Stop the stream. Never blocks: closing the response from this thread
        would wait for the reader's lock, so the socket is shut down under the
        reader instead and the reader thread closes everything as it exits."""
        self._cancelled.set()
        response = self._response
        if response is None:
            return
        connection = getattr(response.raw, "connection", None) or \
            getattr(response.raw, "_connection", None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
