"""Authentication, tenant isolation, TLS and mutual TLS against a real bridge (toy engine)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.errors import InvalidArgument
from rl_client import AsyncBridgeClient
from rl_client.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from server.auth import hash_token

ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210"
AUTH = {"token_hashes": [f"alice:{hash_token(ALICE)}", f"bob:{hash_token(BOB)}"]}


async def test_tokens_are_required_and_tenants_are_isolated(start_bridge: Any) -> None:
    server, anonymous = await start_bridge(auth=AUTH)
    target = f"127.0.0.1:{server.port}"
    alice = AsyncBridgeClient(target, token=ALICE)
    bob = AsyncBridgeClient(target, token=BOB)
    wrong = AsyncBridgeClient(target, token="not-a-token")
    try:
        with pytest.raises(UnauthenticatedError, match="missing bearer token"):
            await anonymous.start_episode([1, 2, 3])
        with pytest.raises(UnauthenticatedError, match="invalid bearer token"):
            await wrong.start_episode([1, 2, 3])
        ep = (await alice.start_episode([1, 2, 3], sampling={"max_tokens": 4})).episode_id
        with pytest.raises(UnauthenticatedError):
            await anonymous.step(ep)
        with pytest.raises(PermissionDeniedError, match="another tenant"):
            await bob.step(ep)
        with pytest.raises(PermissionDeniedError, match="another tenant"):
            await bob.end_episode(ep)
        assert len((await alice.step(ep)).token_ids) <= 4
        assert len(await alice.end_episode(ep)) > 3
        # Probes need no token.
        async with grpc.aio.insecure_channel(target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for c in (alice, bob, wrong):
            await c.close()


async def test_only_admin_tenants_may_update_weights(start_bridge: Any, caplog: pytest.LogCaptureFixture) -> None:
    server, _ = await start_bridge(auth=AUTH | {"admin_tenants": ["alice"]})
    target = f"127.0.0.1:{server.port}"
    alice = AsyncBridgeClient(target, token=ALICE)
    bob = AsyncBridgeClient(target, token=BOB)
    try:
        with caplog.at_level("INFO", logger="primerl.audit"):
            with pytest.raises(PermissionDeniedError, match="tenant 'bob' may not call UpdateWeights"):
                await bob.update_weights()
            assert await alice.update_weights() == 1
        audit = [r.getMessage() for r in caplog.records if r.name == "primerl.audit"]
        assert any("'bob'" in m and "denied" in m for m in audit)
        assert any("'alice'" in m and "allowed" in m for m in audit)
        assert not any(ALICE in m or BOB in m for m in audit)  # never the tokens
    finally:
        await alice.close()
        await bob.close()


async def test_malformed_token_entries_are_refused_at_start(start_bridge: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"auth.token_hashes\[0\]: expected 'TENANT:SHA256HEX'"):
        await start_bridge(auth={"token_hashes": ["alice:deadbeef"]})
    empty = tmp_path / "empty"
    empty.write_text("# no tenants yet\n\n")
    with pytest.raises(InvalidArgument, match="refusing to start without authentication"):
        await start_bridge(auth={"tokens_file": str(empty)})
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# tenants\nalice:{hash_token(ALICE)}\n\n")
    server, _ = await start_bridge(auth={"tokens_file": str(tokens)})
    client = AsyncBridgeClient(f"127.0.0.1:{server.port}", token=ALICE)
    try:
        await client.discard_episode((await client.start_episode([1, 2])).episode_id)
    finally:
        await client.close()


def _pem(obj: Any) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return bytes(
        obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _cert(name: str, key: Any, issuer: tuple[x509.Certificate, Any] | None, *, ca: bool = False) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost and a client certificate, generated here."""
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("primerl-test-ca", ca_key, None, ca=True)
    files: dict[str, Path] = {}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(name, key, (ca, ca_key))
        (root / f"{name}.key").write_bytes(_pem(key))
        (root / f"{name}.crt").write_bytes(_pem(cert))
        files[name + "_key"], files[name + "_crt"] = root / f"{name}.key", root / f"{name}.crt"
    (root / "ca.crt").write_bytes(_pem(ca))
    files["ca"] = root / "ca.crt"
    return files


async def _works(target: str, credentials: grpc.ChannelCredentials | None) -> bool:
    client = AsyncBridgeClient(target, credentials=credentials, timeout=5)
    try:
        await client.discard_episode((await client.start_episode([1, 2, 3])).episode_id)
        return True
    except UnavailableError:
        return False
    finally:
        await client.close()


async def test_tls_and_mutual_tls(start_bridge: Any, pki: dict[str, Path]) -> None:
    ca = pki["ca"].read_bytes()
    tls = {"cert_file": str(pki["server_crt"]), "key_file": str(pki["server_key"])}
    server, _ = await start_bridge(tls=tls)
    target = f"localhost:{server.port}"
    assert await _works(target, grpc.ssl_channel_credentials(root_certificates=ca))
    assert not await _works(target, None)  # plaintext is refused on a TLS port

    server, _ = await start_bridge(tls=tls | {"client_ca_file": str(pki["ca"])})
    target = f"localhost:{server.port}"
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=pki["client_key"].read_bytes(),
        certificate_chain=pki["client_crt"].read_bytes(),
    )
    assert await _works(target, with_cert)
    assert not await _works(target, grpc.ssl_channel_credentials(root_certificates=ca))  # no client certificate


async def test_tls_config_errors_are_clear(start_bridge: Any, pki: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgument, match=r"both tls\.cert_file and tls\.key_file"):
        await start_bridge(tls={"cert_file": str(pki["server_crt"])})
    with pytest.raises(InvalidArgument, match=r"tls\.key_file '/nonexistent' cannot be read"):
        await start_bridge(tls={"cert_file": str(pki["server_crt"]), "key_file": "/nonexistent"})
    with pytest.raises(InvalidArgument, match=r"tls\.client_ca_file needs tls\.cert_file"):
        await start_bridge(tls={"client_ca_file": str(pki["ca"])})


def test_hash_token_cli_prints_the_entry_the_bridge_accepts() -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "server", "hash-token", "carol"]
    out = subprocess.run(cmd, input=ALICE, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"carol:{hash_token(ALICE)}"
    new = subprocess.run([*cmd, "--new"], capture_output=True, text=True)
    token = new.stderr.rsplit(":", 1)[1].strip()
    assert new.stdout.strip() == f"carol:{hash_token(token)}" and len(token) >= 32
    bad = subprocess.run(cmd, input="", capture_output=True, text=True)
    assert bad.returncode == 2 and "no token on stdin" in bad.stderr


async def test_per_tenant_admission_and_retry_after(start_bridge: Any) -> None:
    import asyncio

    from rl_client.errors import ResourceExhaustedError

    server, _ = await start_bridge(
        auth=AUTH,
        admission={"max_episodes_per_tenant": 2, "max_inflight_steps_per_tenant": 1},
        engine={"toy": {"token_delay_s": 0.01}},
    )
    target = f"127.0.0.1:{server.port}"
    alice = AsyncBridgeClient(target, token=ALICE)
    bob = AsyncBridgeClient(target, token=BOB)
    try:
        a1 = (await alice.start_episode([1, 2, 3], sampling={"max_tokens": 30, "ignore_eos": True})).episode_id
        a2 = (await alice.start_episode([1, 2, 3], sampling={"max_tokens": 30, "ignore_eos": True})).episode_id
        with pytest.raises(ResourceExhaustedError, match="limit of 2 open episodes of tenant 'alice'") as err:
            await alice.start_episode([1, 2, 3])
        assert err.value.retry_after_s == 1.0  # the bridge's hint, from trailing metadata
        await bob.discard_episode((await bob.start_episode([1, 2, 3])).episode_id)  # bob has his own quota
        running = asyncio.create_task(alice.step(a1))
        await asyncio.sleep(0.1)
        with pytest.raises(ResourceExhaustedError, match="Steps running") as err:
            await alice.step(a2)
        assert err.value.retry_after_s == 0.1
        assert len((await running).token_ids) == 30
        assert len((await alice.step(a2)).token_ids) == 30  # the slot is free again
    finally:
        await alice.close()
        await bob.close()
