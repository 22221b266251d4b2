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

    served = {"ips": [HOST, "10.96.0.1"], "dns": ["localhost", "kubernetes", "kubernetes.default.svc"]}
    issue(pki, "apiserver", "kube-apiserver", None, **served)
    issue(pki, "admin", "admin", "system:masters")
    # The node agent's kubelet endpoint (container logs), and the API server's client identity towards it.
    issue(pki, "kubelet", "local-kubelet", None, **served)
    issue(pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
    issue(pki, "webhook", "local-webhooks", None, **served)  # admission webhooks served on loopback (Kueue)
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


def issue(pki: Path, file: str, cn: str, org: str | None, ips: list[str] = (), dns: list[str] = ()) -> None:
    """A certificate from the CA of `pki` (write_pki's) as `file`.crt/.key: a client one, or with `ips` and
    `dns` a serving one for those addresses and names."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca.subject)
        .public_key(k.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
    )
    if ips or dns:
        sans = [*(x509.DNSName(d) for d in dns), *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if ips or dns else ExtendedKeyUsageOID.CLIENT_AUTH
    b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    pem = k.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    (pki / f"{file}.key").write_bytes(pem)
    (pki / f"{file}.crt").write_bytes(b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
