"""TLS for gRPC: every server port and client channel of the project is made here.

``open_channel`` and ``add_port`` take a :class:`~retina_common.config.TlsConfig`;
with ``tls.enabled = false`` (the default, and the local cluster's setting) they
make the plaintext channel or port gRPC makes without TLS.

A process states its TLS settings once, at start (:func:`configure`); channels
opened without an explicit config use them. Spark tasks run in other processes
(Python workers, possibly on other machines): :func:`spark_executor_env` is the
environment that gives them the driver's settings, read back by :func:`current`.
Certificate files are read when first used; a renewed certificate takes effect
at the process's next start.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import grpc

from retina_common.config import ConfigError, TlsConfig

# Carries the driver's [tls] section (JSON) to Spark tasks.
ENV_VAR = "RETINA_TLS_CONFIG"
ChannelOptions = Sequence[tuple[str, Any]]

_process_default: TlsConfig | None = None


def configure(tls: TlsConfig) -> None:
    """This process's TLS settings, used by channels opened without explicit ones."""
    global _process_default
    _process_default = tls


def current() -> TlsConfig:
    """The settings given to :func:`configure`, else those in ``$RETINA_TLS_CONFIG``
    (a Spark task), else TLS off."""
    if _process_default is not None:
        return _process_default
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return TlsConfig()
    try:
        return TlsConfig(**json.loads(raw))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"${ENV_VAR} is not a [tls] section as JSON: {exc}") from None


def spark_executor_env(tls: TlsConfig | None = None) -> dict[str, str]:
    """Spark settings that hand ``tls`` (default: :func:`current`) to every task."""
    tls = current() if tls is None else tls
    if not tls.enabled:
        return {}
    return {f"spark.executorEnv.{ENV_VAR}": json.dumps(dataclasses.asdict(tls))}


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file; ConfigError naming the setting when unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{setting}: {path!r} is not a PEM file")
    return data


@functools.lru_cache(maxsize=8)
def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    if not tls.cert_file or not tls.key_file:
        raise ConfigError("tls.enabled = true: a server needs tls.cert_file and tls.key_file")
    pair = (read_pem(tls.key_file, "tls.key_file"), read_pem(tls.cert_file, "tls.cert_file"))
    return grpc.ssl_server_credentials(
        [pair], root_certificates=read_pem(tls.ca_file, "tls.ca_file"),
        require_client_auth=tls.client_cert_required)


@functools.lru_cache(maxsize=8)
def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    key = cert = None
    if tls.client_cert_file:
        key = read_pem(tls.client_key_file, "tls.client_key_file")
        cert = read_pem(tls.client_cert_file, "tls.client_cert_file")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca_file, "tls.ca_file"), private_key=key,
        certificate_chain=cert)


def open_channel(address: str, tls: TlsConfig | None = None,
                 options: ChannelOptions = ()) -> grpc.Channel:
    """A client channel to ``address``: TLS when ``tls`` (default :func:`current`) says so."""
    tls = current() if tls is None else tls
    if not tls.enabled:
        return grpc.insecure_channel(address, options=list(options))
    opts = list(options)
    if tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return grpc.secure_channel(address, channel_credentials(tls), options=opts)


def add_port(server: grpc.Server, address: str, tls: TlsConfig | None = None) -> int:
    """Bind ``address`` on ``server`` (TLS as ``tls`` says); the bound port, 0 on failure."""
    tls = current() if tls is None else tls
    if not tls.enabled:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def check_server(tls: TlsConfig) -> None:
    """ConfigError now, at start, if a server could not listen with ``tls``."""
    if tls.enabled:
        server_credentials(tls)
