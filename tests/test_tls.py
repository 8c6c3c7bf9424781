"""TLS on every connection: gRPC servers and clients (server certificates, mutual TLS),
etcd over https and PostgreSQL with sslmode=verify-full, with certificates made here.

Two CAs are made: ``good`` signs every server and client certificate the cluster
uses; ``other`` signs a client certificate and stands in for a client that trusts
the wrong CA. The gRPC cases run a real TransServer and a real Retina node
configured with mutual TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import psycopg2
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from devtools.cluster import (
    EtcdInstance,
    PostgresInstance,
    free_port,
    free_ports,
    grpc_serving,
    start_postgres,
    stop_postgres,
    write_config,
)
from retina_common.catalog import Catalog, CatalogUnavailable, ColumnSpec
from retina_common.client import TableWriter, requests_by_node
from retina_common.config import ConfigError, TlsConfig, load_config
from retina_common.etcd import EtcdError, EtcdStore, EtcdUnavailable
from retina_common.grpc_server import ServerHandle
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import Snapshot, SnapshotReader
from retina_common.recovery_driver import drive_recovery
from retina_common.tls import ENV_VAR, open_channel, spark_executor_env
from retina_common.topology import Topology

from .dataplane import RetinaProcess
from .support import ROOT, TransServerProcess, delete_prefix, eventually, rpc_error

SCHEMA = "sec"
# Every channel of a test gets its own subchannels: gRPC shares them between channels
# to one address, and a case must not ride on another case's handshake.
OWN = [("grpc.use_local_subchannel_pool", 1)]


# --- certificates -------------------------------------------------------------------------
@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2)))


def make_ca(name: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, _name(name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    return Issued(cert, key)


def issue(ca: Issued, name: str, *, server: bool) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    # etcd's JSON gateway calls etcd's own gRPC port presenting the server
    # certificate, so with --client-cert-auth a server certificate must serve both ends.
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (_builder(name, ca.cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.DNSName("trans.retina.test"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def write_pem(directory: Path, stem: str, issued: Issued) -> tuple[str, str]:
    cert = directory / f"{stem}.crt"
    key = directory / f"{stem}.key"
    cert.write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(issued.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    key.chmod(0o600)
    return str(cert), str(key)


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca: str  # the good CA
    other_ca: str
    server: tuple[str, str]  # cert, key (SANs: localhost, trans.retina.test, 127.0.0.1)
    client: tuple[str, str]  # signed by the good CA
    rogue_client: tuple[str, str]  # signed by the other CA

    def tls(self, **changes: object) -> TlsConfig:
        """Mutual TLS as the cluster runs it; ``changes`` make a variant."""
        base = TlsConfig(enabled=True, cert_file=self.server[0], key_file=self.server[1],
                         ca_file=self.ca, client_cert_required=True,
                         client_cert_file=self.client[0], client_key_file=self.client[1])
        return replace(base, **changes)


@pytest.fixture(scope="module")
def pki(base_dir: Path) -> Iterator[Pki]:
    # Under base_dir (0755), not tmp_path: the postgres user reads the server files.
    directory = base_dir / f"pki-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    directory.chmod(0o755)
    good, other = make_ca("retina test CA"), make_ca("some other CA")
    ca = directory / "ca.crt"
    ca.write_bytes(good.cert.public_bytes(serialization.Encoding.PEM))
    other_ca = directory / "other-ca.crt"
    other_ca.write_bytes(other.cert.public_bytes(serialization.Encoding.PEM))
    for path in (ca, other_ca):
        path.chmod(0o644)
    yield Pki(directory, str(ca), str(other_ca),
              write_pem(directory, "server", issue(good, "retina server", server=True)),
              write_pem(directory, "client", issue(good, "retina client", server=False)),
              write_pem(directory, "rogue", issue(other, "rogue client", server=False)))
    shutil.rmtree(directory, ignore_errors=True)


def section(values: TlsConfig) -> str:
    fields = {k: getattr(values, k) for k in values.__dataclass_fields__}
    return "\n[tls]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())


# --- configuration -------------------------------------------------------------------------
def test_tls_is_off_by_default_and_half_settings_are_config_errors(pki: Pki) -> None:
    assert load_config(env={}).tls.enabled is False
    cases = {
        "needs tls.ca_file": {"RETINA__TLS__ENABLED": "true"},
        "needs tls.client_cert_file": {
            "RETINA__TLS__ENABLED": "true", "RETINA__TLS__CA_FILE": pki.ca,
            "RETINA__TLS__CLIENT_CERT_REQUIRED": "true"},
        "go together": {"RETINA__TLS__ENABLED": "true", "RETINA__TLS__CA_FILE": pki.ca,
                        "RETINA__TLS__CERT_FILE": pki.server[0]},
        "cannot read": {"RETINA__TLS__ENABLED": "true",
                        "RETINA__TLS__CA_FILE": str(pki.directory / "missing.crt")},
        "etcd.cert_file needs etcd.ca_file": {"RETINA__ETCD__CERT_FILE": pki.client[0],
                                              "RETINA__ETCD__KEY_FILE": pki.client[1]},
        "catalog.sslmode": {"RETINA__CATALOG__SSLMODE": "verify-everything"},
        # Looks secured, would run plaintext / unverified: refused, not silently accepted.
        "tls.ca_file is set but tls.enabled = false": {"RETINA__TLS__CA_FILE": pki.ca},
        "need catalog.sslmode": {"RETINA__CATALOG__SSLROOTCERT": pki.ca},
    }
    for message, env in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(env=env)


def test_catalog_ssl_keys_are_merged_into_the_dsn(pki: Pki) -> None:
    config = load_config(env={"RETINA__CATALOG__DSN": "host=db port=5432 sslmode=disable",
                              "RETINA__CATALOG__SSLMODE": "verify-full",
                              "RETINA__CATALOG__SSLROOTCERT": pki.ca})
    params = dict(part.split("=", 1) for part in config.catalog.dsn.split())
    assert params["sslmode"] == "verify-full"  # the explicit key wins over the DSN's
    assert params["sslrootcert"] == pki.ca
    assert params["host"] == "db"


@pytest.mark.integration
def test_a_server_without_its_certificate_exits_2(tmp_path: Path, pki: Pki) -> None:
    config = tmp_path / "retina.toml"
    config.write_text('topology_file = "topology.toml"\n' + section(
        TlsConfig(enabled=True, ca_file=pki.ca)))
    done = subprocess.run([sys.executable, "-m", "trans_gate", "--config", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "tls.cert_file" in done.stdout + done.stderr


@pytest.mark.integration
def test_spark_tasks_get_the_drivers_tls_settings(pki: Pki) -> None:
    tls = pki.tls(server_name_override="trans.retina.test")
    conf = spark_executor_env(tls)
    assert spark_executor_env(TlsConfig()) == {}  # TLS off: nothing to hand over
    (key, value), = conf.items()
    assert key == f"spark.executorEnv.{ENV_VAR}"
    # A task's process: no configure() call, only the executor environment.
    done = subprocess.run(
        [sys.executable, "-c", "import dataclasses, json; from retina_common import tls; "
                               "print(json.dumps(dataclasses.asdict(tls.current())))"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, ENV_VAR: value})
    assert done.returncode == 0, done.stderr
    assert TlsConfig(**json.loads(done.stdout)) == tls


# --- gRPC, in process: server-only TLS ------------------------------------------------------
def test_server_tls_without_client_certificates(pki: Pki) -> None:
    server_tls = pki.tls(client_cert_required=False, client_cert_file="", client_key_file="")
    handle = ServerHandle(f"127.0.0.1:{free_port()}", 2, [], tls=server_tls)
    handle.start()
    handle.set_serving(True)
    try:
        client = TlsConfig(enabled=True, ca_file=pki.ca)
        assert grpc_serving(handle.address, tls=client)
        # The name in the address need not be in the certificate when an override is.
        localhost = handle.address.replace("127.0.0.1", "localhost")
        assert grpc_serving(localhost, tls=replace(
            client, server_name_override="trans.retina.test"))
        refused = {
            "plaintext": TlsConfig(),
            "wrong CA": replace(client, ca_file=pki.other_ca),
            "wrong name": replace(client, server_name_override="elsewhere.example"),
        }
        for what, tls in refused.items():
            exc = rpc_error(lambda tls=tls: grpc_serving(handle.address, tls=tls))
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, what
    finally:
        handle.stop(0)


# --- gRPC: a TransServer and a Retina node with mutual TLS ---------------------------------
@dataclass
class SecurePlane:
    trans: TransServerProcess
    retina: RetinaProcess
    node: str
    topology: Topology
    writer: TableWriter
    tls: TlsConfig  # a well-configured client's settings
    config: Path  # the Retina node's retina.toml, [tls] included

    def write(self, rows: list[dict[str, object]]) -> None:
        """One committed write transaction over TLS (the node made READY first)."""
        drive_recovery(self.node_stub(self.tls))  # a no-op once READY
        trans = self.trans_stub(self.tls)
        begun = eventually(lambda: trans.BeginTrans(tpb.BeginTransRequest(), timeout=5), 15,
                           "a write transaction")
        requests = requests_by_node(SCHEMA, [self.writer.updates(begun.timestamp,
                                                                 inserts=rows)])
        self.node_stub(self.tls).UpdateRecord(requests[self.node], timeout=30)
        trans.CommitTrans(tpb.CommitTransRequest(trans_id=begun.trans_id), timeout=10)

    def read(self, min_files: int = 0) -> Snapshot:
        """A gated snapshot over TLS, once at least ``min_files`` files are published."""
        reader = SnapshotReader(self.trans.address, self.topology, tls=self.tls)
        try:
            return eventually(lambda: (snap := reader.read(SCHEMA, "accounts")).files_read
                              >= min_files and snap, 15, "a gated read")
        finally:
            reader.close()

    def trans_stub(self, tls: TlsConfig) -> trans_pb2_grpc.TransServiceStub:
        return trans_pb2_grpc.TransServiceStub(open_channel(self.trans.address, tls, OWN))

    def node_stub(self, tls: TlsConfig) -> retina_pb2_grpc.RetinaWorkerServiceStub:
        return retina_pb2_grpc.RetinaWorkerServiceStub(open_channel(self.node, tls, OWN))


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, pki: Pki, etcd_server: EtcdInstance,
          pg_server: PostgresInstance) -> Iterator[SecurePlane]:
    workdir = tmp_path_factory.mktemp("tls-plane")
    store = EtcdStore([etcd_server.endpoint])
    delete_prefix(store, "/pixels/")
    dbname = f"t_{uuid.uuid4().hex[:12]}"
    pg_server.create_database(dbname)
    dsn = pg_server.dsn(dbname)
    catalog = Catalog(dsn)
    catalog.bootstrap()
    catalog.create_schema(SCHEMA)
    table = catalog.create_table(SCHEMA, "accounts", [ColumnSpec("id", "int64"),
                                                      ColumnSpec("owner", "string")], ["id"])
    node = f"127.0.0.1:{free_ports(1)[0]}"
    topology = Topology((node,), 4)
    tls = pki.tls()
    trans = TransServerProcess(workdir / "trans", etcd_server.endpoint, dsn, [node])
    with open(trans.config_path, "a") as f:
        f.write(section(tls))
    config = workdir / "retina.toml"
    write_config(config, etcd_endpoint=etcd_server.endpoint, dsn=dsn,
                 topology_file=trans.workdir / "topology.toml", storage_root=workdir / "storage",
                 trans_listen=trans.address, trans_metrics="off",
                 extra={"retina": {"state_dir": str(workdir / "state"),
                                   "flush_interval_ms": 300, "anonymous_writes": True}})
    with open(config, "a") as f:
        f.write(section(tls))
    retina = RetinaProcess(node, config, workdir)
    sp = SecurePlane(trans, retina, node, topology, TableWriter(table, topology), tls, config)
    try:
        trans.start(wait=False)
        eventually(lambda: trans.alive() and grpc_serving(trans.address, tls=tls), 30,
                   f"the TransServer to serve over TLS ({trans.log_tail()})")
        retina.start(wait=False)
        status = sp.node_stub(tls)
        eventually(lambda: retina.alive() and status.GetRetinaStatus(
            rpb.GetRetinaStatusRequest(), timeout=2), 60,
            f"the Retina node to answer over TLS ({retina.log_tail()})")
        yield sp
    finally:
        retina.stop()
        trans.stop()
        catalog.close()
        pg_server.drop_database(dbname)
        delete_prefix(store, "/pixels/")


@pytest.mark.integration
def test_node_reaches_ready_through_a_tls_only_trans_server(plane: SecurePlane) -> None:
    # MarkReady waits on the node's own calls to the TransServer (its high
    # watermark), which accepts only TLS with a client certificate.
    drive_recovery(plane.node_stub(plane.tls))
    status = plane.node_stub(plane.tls).GetRetinaStatus(rpb.GetRetinaStatusRequest(),
                                                        timeout=10)
    assert status.state == rpb.READY, plane.retina.log_tail()


@pytest.mark.integration
def test_tls_client_writes_and_reads_back(plane: SecurePlane) -> None:
    rows = [{"id": i, "owner": f"owner-{i}"} for i in range(5)]
    plane.write(rows)
    read = sorted(plane.read().table.to_pylist(), key=lambda r: r["id"])
    assert [r for r in read if r["id"] < 100] == rows


@pytest.mark.integration
def test_spark_snapshot_query_over_tls(plane: SecurePlane) -> None:
    # The driver's channels and its tasks' (one per published file) all need TLS
    # with the client certificate; the job reads them from the same retina.toml.
    plane.write([{"id": 100 + i, "owner": "spark"} for i in range(3)])
    expected = plane.read(min_files=1)  # the rows are in a published file: a task reads it
    done = subprocess.run(
        [sys.executable, "-m", "spark_jobs.snapshot_query", "--config", str(plane.config),
         "--table", f"{SCHEMA}.accounts", "--json", "--master", "local[1]",
         "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=1g"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    info = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    # More files may have been published since (the same rows); at least one task ran.
    assert info["count"] == expected.table.num_rows and info["files"] >= 1


@pytest.mark.integration
def test_clients_without_the_right_credentials_are_refused(pki: Pki,
                                                           plane: SecurePlane) -> None:
    refused = {
        "plaintext": TlsConfig(),
        "trusts another CA": TlsConfig(
            enabled=True, ca_file=pki.other_ca, client_cert_file=pki.client[0],
            client_key_file=pki.client[1]),
        "no client certificate": TlsConfig(enabled=True, ca_file=pki.ca),
        "client certificate from another CA": TlsConfig(
            enabled=True, ca_file=pki.ca, client_cert_file=pki.rogue_client[0],
            client_key_file=pki.rogue_client[1]),
    }
    for what, tls in refused.items():
        exc = rpc_error(lambda tls=tls: plane.trans_stub(tls).BeginTrans(
            tpb.BeginTransRequest(read_only=True), timeout=5))
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, f"TransServer, {what}"
        exc = rpc_error(lambda tls=tls: plane.node_stub(tls).GetRetinaStatus(
            rpb.GetRetinaStatusRequest(), timeout=5))
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, f"Retina node, {what}"
    # ... while the well-configured client gets answers from both.
    assert plane.node_stub(plane.tls).GetRetinaStatus(rpb.GetRetinaStatusRequest(),
                                                      timeout=5).node_id == plane.node
    assert plane.trans_stub(plane.tls).GetHighWatermark(tpb.GetHighWatermarkRequest(),
                                                        timeout=5).high_watermark >= 0


# --- etcd over https ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[str]:
    """A private etcd serving https only and demanding client certificates."""
    data = tmp_path_factory.mktemp("tls-etcd")
    client_port, peer_port = free_ports(2)
    client, peer = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(data / "etcd.log", "ab")  # noqa: SIM115 - closed after the process
    proc = subprocess.Popen(
        [shutil.which("etcd") or "etcd", "--name", "tls", "--data-dir", str(data / "member"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"tls={peer}", "--log-level", "warn",
         "--cert-file", pki.server[0], "--key-file", pki.server[1],
         "--trusted-ca-file", pki.ca, "--client-cert-auth"],
        stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"127.0.0.1:{client_port}"
    try:
        store = EtcdStore([endpoint], 2, ca_file=pki.ca, cert_file=pki.client[0],
                          key_file=pki.client[1])
        eventually(lambda: proc.poll() is None and store.get("/probe") is None, 30,
                   f"etcd over https ({(data / 'etcd.log').read_text()[-2000:]})")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.mark.integration
def test_etcd_store_over_https_with_a_client_certificate(pki: Pki, tls_etcd: str) -> None:
    config = load_config(env={"RETINA__ETCD__ENDPOINTS": tls_etcd,
                              "RETINA__ETCD__CA_FILE": pki.ca,
                              "RETINA__ETCD__CERT_FILE": pki.client[0],
                              "RETINA__ETCD__KEY_FILE": pki.client[1]})
    store = EtcdStore.from_config(config.etcd)
    seen: list[str] = []
    _, revision = store.get_prefix("/pixels/tls/")
    watch = store.watch_prefix("/pixels/tls/", revision + 1,
                               lambda events: seen.extend(e.key for e in events),
                               lambda reason: seen.append(f"broken: {reason}"))
    try:
        store.put("/pixels/tls/a", "1")
        assert store.get("/pixels/tls/a").value == b"1"
        # The watch stream is https with the same CA and client certificate.
        eventually(lambda: "/pixels/tls/a" in seen, 10, f"the watch event (saw {seen})")
    finally:
        watch.cancel()
        watch.join(5)


@pytest.mark.integration
def test_etcd_store_without_the_right_ca_or_certificate_fails(pki: Pki, tls_etcd: str) -> None:
    with pytest.raises(EtcdUnavailable, match="certificate verify failed"):
        EtcdStore([tls_etcd], 2, ca_file=pki.other_ca, cert_file=pki.client[0],
                  key_file=pki.client[1]).get("/probe")
    with pytest.raises(EtcdError):  # plain http to an https-only etcd
        EtcdStore([tls_etcd], 2).get("/probe")
    with pytest.raises(EtcdError):  # etcd demands a client certificate
        EtcdStore([tls_etcd], 2, ca_file=pki.ca).get("/probe")


# --- PostgreSQL with ssl = on ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_postgres(base_dir: Path, pki: Pki) -> Iterator[PostgresInstance]:
    """A private PostgreSQL with ssl on and the server certificate made here."""
    key = pki.directory / "pg-server.key"
    shutil.copy(pki.server[1], key)
    if os.geteuid() == 0:  # the server runs as postgres and refuses a key others can read
        pw = pwd.getpwnam("postgres")
        os.chown(key, pw.pw_uid, pw.pw_gid)
    key.chmod(0o600)
    Path(pki.server[0]).chmod(0o644)
    data = base_dir / f"pg-tls-{uuid.uuid4().hex[:8]}"
    inst = start_postgres(data, base_dir / f"{data.name}.log", durable=False, settings={
        "ssl": "on", "ssl_cert_file": pki.server[0], "ssl_key_file": str(key)})
    try:
        inst.create_database("retina")
        yield inst
    finally:
        stop_postgres(inst.data_dir)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.integration
def test_catalog_connects_with_verify_full(pki: Pki, tls_postgres: PostgresInstance) -> None:
    config = load_config(env={"RETINA__CATALOG__DSN": tls_postgres.dsn("retina"),
                              "RETINA__CATALOG__SSLMODE": "verify-full",
                              "RETINA__CATALOG__SSLROOTCERT": pki.ca})
    catalog = Catalog(config.catalog.dsn)
    try:
        catalog.bootstrap()
        catalog.create_schema("over_tls")
        catalog.create_table("over_tls", "t", [ColumnSpec("id", "int64")], ["id"])
        assert catalog.list_tables("over_tls") == ["t"]
    finally:
        catalog.close()
    conn = psycopg2.connect(config.catalog.dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            assert cur.fetchone() == (True,)
    finally:
        conn.close()


@pytest.mark.integration
def test_catalog_refuses_a_server_its_ca_did_not_sign(pki: Pki,
                                                      tls_postgres: PostgresInstance) -> None:
    dsn = f"{tls_postgres.dsn('retina')} sslmode=verify-full sslrootcert={pki.other_ca}"
    catalog = Catalog(dsn, connect_timeout_s=5)
    try:
        with pytest.raises(CatalogUnavailable, match="certificate verify failed"):
            catalog.bootstrap()
    finally:
        catalog.close()
