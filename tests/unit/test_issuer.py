"""Progress tokens verified offline: an issuer of our own (an RSA key, tokens shaped as the API server mints
them) signs good and forged tokens; only good ones name a sender, and nothing a forger sends costs a fetch
beyond one per refresh interval."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from sharded_operator.decide.progress import Refusal, Sender
from sharded_operator.run.issuer import IssuerKeys, key_id, sender_from_claims

ISSUER, AUD = "https://kubernetes.default.svc", "training.sharded.dev/progress"


def new_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


KEY, OTHER = new_key(), new_key()


def jwk(key, kid: str) -> dict:
    return {**jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True), "kid": kid, "alg": "RS256",
            "use": "sig"}  # fmt: skip


def claims(**over) -> dict:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": [AUD], "sub": "system:serviceaccount:team:default", "iat": now, "nbf": now,
            "exp": now + 600, "kubernetes.io": {"namespace": "team", "pod": {"name": "j-0", "uid": "pod-uid"},
                                                "serviceaccount": {"name": "default", "uid": "sa-uid"}}}  # fmt: skip
    return {**base, **over}


def token(key=KEY, kid: str = "k1", alg: str = "RS256", **over) -> str:
    return jwt.encode(claims(**over), key, algorithm=alg, headers={"kid": kid})


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def issuer(keys=None, discovery=True, clock=None) -> tuple[IssuerKeys, list]:
    calls: list[str] = []

    def fetch_discovery():
        calls.append("discovery")
        return {"issuer": ISSUER, "jwks_uri": f"{ISSUER}/openid/v1/jwks"} if discovery else None

    def fetch_keys():
        calls.append("keys")
        return {"keys": keys if keys is not None else [jwk(KEY, "k1")]}

    return IssuerKeys(fetch_discovery, fetch_keys, clock or Clock()), calls


def test_a_token_the_issuer_signed_names_its_pod():
    keys, calls = issuer()
    assert keys.wants_refresh("k1")
    keys.refresh()
    assert keys.verify(token(), AUD) == Sender("team", "default", "j-0", "pod-uid")
    assert calls == ["discovery", "keys"] and not keys.wants_refresh("k1")


@pytest.mark.parametrize(
    "forged,why",
    [
        (lambda: token(key=OTHER), "Signature verification failed"),  # a garbage signature, plausible claims
        (lambda: token(iss="https://evil.example"), "issuer"),
        (lambda: token(aud=["https://kubernetes.default.svc"]), "audience"),
        (lambda: token(exp=int(time.time()) - 10), "expired"),
        (lambda: token(**{"kubernetes.io": {"namespace": "team"}}), "bound to a pod"),
        (lambda: token(sub="system:serviceaccount:other:default"), "bound to a pod"),
        (lambda: token(kid="unknown"), "not signed by this cluster"),
        (
            lambda: jwt.encode(
                claims(), "a-shared-secret-of-thirty-two-bytes!", algorithm="HS256", headers={"kid": "k1"}
            ),
            "not signed",
        ),  # an HMAC the public key could pass as
        (lambda: "a.b.c", "not a ServiceAccount token"),
    ],
)
def test_every_forgery_is_refused_without_an_api_call(forged, why):
    keys, calls = issuer()
    keys.refresh()
    calls.clear()
    with pytest.raises(Refusal) as r:
        keys.verify(forged(), AUD)
    assert r.value.status == 401 and why in r.value.reason
    assert calls == []


def test_unknown_key_ids_fetch_the_keys_at_most_once_per_interval():
    clock = Clock()
    keys, calls = issuer(clock=clock)
    keys.refresh()
    calls.clear()
    fetched = 0
    for i in range(1000):  # a flood of tokens naming key ids nobody has
        kid = key_id(token(kid=f"forged-{i}"))
        if keys.wants_refresh(kid):
            keys.refresh()
            fetched += 1
        clock.t += 0.015  # 1,000 tokens over 15 s: one interval (10 s) passes
    assert fetched == 1 and calls == ["discovery", "keys"]
    assert not keys.wants_refresh(None)  # junk with no key id never fetches


def test_a_rotated_key_is_picked_up_and_a_failed_fetch_keeps_the_old_keys():
    clock = Clock()
    published = [jwk(KEY, "k1")]
    keys, _ = issuer(keys=published, clock=clock)
    keys.refresh()
    published.append(jwk(OTHER, "k2"))
    clock.t += 11
    assert keys.wants_refresh("k2")
    keys.refresh()
    assert keys.verify(token(key=OTHER, kid="k2"), AUD).pod_name == "j-0"

    def broken():
        raise OSError("connection refused")

    keys.fetch_keys = broken
    clock.t += 11
    keys.refresh()
    assert keys.available and keys.verify(token(), AUD).pod_uid == "pod-uid"


def test_an_api_server_without_discovery_leaves_verification_to_token_review():
    keys, calls = issuer(discovery=False)
    keys.refresh()
    assert keys.available is False and calls == ["discovery"]


def test_claims_must_name_namespace_serviceaccount_and_pod_consistently():
    good = claims()
    assert sender_from_claims(good).namespace == "team"
    for bad in ({**good, "kubernetes.io": "x"}, {**good, "sub": "alice"},
                {**good, "kubernetes.io": {**good["kubernetes.io"], "pod": {"name": "", "uid": "u"}}}):  # fmt: skip
        with pytest.raises(Refusal):
            sender_from_claims(bad)
