"""The local control plane's certificates and the admin kubeconfig made from them."""

from __future__ import annotations

import datetime
from pathlib import Path

HOST = "127.0.0.1"  # every server of the local stack binds to loopback only


def write_pki(pki: Path) -> None:
    """A CA, the API server's serving cert, an admin client cert, the service-account key pair, and the
    node agent's kubelet serving cert with the API server's client cert towards it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    later = now + datetime.timedelta(days=365)

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def write_key(k: rsa.RSAPrivateKey, name: str) -> None:
        (pki / name).write_bytes(
            k.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("sharded-local-ca"))
        .issuer_name(name("sharded-local-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write_key(ca_key, "ca.key")
    (pki / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(file: str, subject: x509.Name, server: bool) -> None:
        k = key()
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(later)
        )
        if server:
            import ipaddress

            sans = [
                x509.DNSName("localhost"),
                x509.DNSName("kubernetes"),
                x509.DNSName("kubernetes.default.svc"),
                x509.IPAddress(ipaddress.ip_address(HOST)),
                x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
            ]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
        else:
            usage = x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        write_key(k, f"{file}.key")
        (pki / f"{file}.crt").write_bytes(b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))

    leaf("apiserver", name("kube-apiserver"), server=True)
    leaf("admin", name("admin", "system:masters"), server=False)
    # The node agent's kubelet endpoint (container logs), and the API server's client identity towards it.
    leaf("kubelet", name("local-kubelet"), server=True)
    leaf("apiserver-kubelet-client", name("kube-apiserver-kubelet-client", "system:masters"), server=False)
    leaf("webhook", name("local-webhooks"), server=True)  # admission webhooks served on loopback (Kueue)
    sa = key()
    write_key(sa, "sa.key")
    (pki / "sa.pub").write_bytes(
        sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def kubeconfig(pki: Path, server: str) -> dict:
    import base64

    def b64(f: str) -> str:
        return base64.b64encode((pki / f).read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [
            {
                "name": "admin",
                "user": {"client-certificate-data": b64("admin.crt"), "client-key-data": b64("admin.key")},
            }
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin", "namespace": "default"}}],
        "current-context": "local",
    }
