"""Progress tokens verified offline, against the API server's service-account issuer keys (OIDC discovery).

A pod's projected token is a JWT the API server signed. Checking its signature, issuer, audience, expiry
and pod binding here, with PyJWT and the issuer's published keys, costs the API server nothing, so a flood
of forged tokens cannot spend a budget that real pods need: only a token that verifies goes on to the pod
lookup (which shows what a signature cannot, that the pod still exists). The keys are fetched once and
again on an unknown key id (the issuer rotated its key), at most once per `min_refresh` seconds however
many unknown ids arrive; an issuer that publishes no keys leaves verification to TokenReview (`intake`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jwt

from sharded_operator.decide.progress import Refusal, Sender

logger = logging.getLogger("sharded_operator.run.issuer")
# What the API server signs with (RSA or ECDSA keys); never "none" or an HMAC a public key could pass as.
ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512")
MAX_KEYS = 64  # a JWKS larger than this is not an issuer's


class IssuerKeys:
    """The issuer and its signing keys by key id, fetched through `fetch_discovery` and `fetch_keys`."""

    def __init__(self, fetch_discovery: Callable[[], dict[str, Any] | None], fetch_keys: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic, min_refresh: float = 10.0):  # fmt: skip
        self.fetch_discovery, self.fetch_keys = fetch_discovery, fetch_keys
        self.clock, self.min_refresh = clock, min_refresh
        self.issuer: str | None = None
        self.keys: dict[str, jwt.PyJWK] = {}
        self.available: bool | None = None  # None: not asked yet; False: the API server publishes no keys
        self.fetched_at = float("-inf")
        self.fetches = 0

    def wants_refresh(self, kid: str | None) -> bool:
        """Whether to fetch the keys before verifying a token of `kid`: never asked, or an unknown id and the
        last fetch long enough ago."""
        if self.available is None:
            return True
        return kid is not None and kid not in self.keys and self.clock() - self.fetched_at >= self.min_refresh

    def refresh(self) -> None:
        """Fetch discovery and the key set (blocking: run it off the event loop). Errors keep the old keys."""
        self.fetched_at, self.fetches = self.clock(), self.fetches + 1
        try:
            discovery = self.fetch_discovery()
            if not discovery or not isinstance(discovery.get("issuer"), str):
                self.available = False
                return
            jwks = self.fetch_keys()
            keys = jwt.PyJWKSet.from_dict({"keys": list(jwks.get("keys") or [])[:MAX_KEYS]}).keys
        except Exception as e:  # unreachable, refused (ApiError), or not a key set: the old keys stay
            logger.warning("service-account issuer keys not refreshed: %s", str(e)[:200])
            if self.available is None:
                self.available = False
            return
        self.issuer, self.available = discovery["issuer"], True
        self.keys = {k.key_id: k for k in keys if k.key_id}

    def verify(self, token: str, audience: str) -> Sender:
        """The sender a token proves, or a 401; no API call."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Refusal(401, "not a ServiceAccount token") from None
        key = self.keys.get(header.get("kid"))
        if key is None or header.get("alg") not in ALGORITHMS:
            raise Refusal(401, "the token is not signed by this cluster's service-account issuer")
        try:
            claims = jwt.decode(token, key=key.key, algorithms=[header["alg"]], audience=audience, issuer=self.issuer,
                                options={"require": ["exp", "iat", "iss", "aud", "sub"]})  # fmt: skip
        except jwt.ExpiredSignatureError:
            raise Refusal(401, "the token has expired") from None
        except jwt.InvalidAudienceError:
            raise Refusal(401, f"the token's audience is not {audience!r}: mount a projected token for it") from None
        except jwt.PyJWTError as e:
            raise Refusal(401, f"token not accepted: {str(e)[:200]}") from None
        return sender_from_claims(claims)


def key_id(token: str) -> str | None:
    """The key id a token's header names, unverified (which key to check it with); None for junk."""
    try:
        kid = jwt.get_unverified_header(token).get("kid")
    except jwt.PyJWTError:
        return None
    return kid if isinstance(kid, str) else None


def sender_from_claims(claims: dict[str, Any]) -> Sender:
    """The ServiceAccount and pod a verified token's claims name, or a 401 when it is not bound to a pod."""
    k8s = claims.get("kubernetes.io")
    k8s = k8s if isinstance(k8s, dict) else {}
    pod, sa = k8s.get("pod"), k8s.get("serviceaccount")
    parts = str(claims.get("sub", "")).split(":")
    if not isinstance(pod, dict) or not isinstance(sa, dict) or len(parts) != 4 or \
            parts[:2] != ["system", "serviceaccount"]:  # fmt: skip
        raise Refusal(401, "the token is not a ServiceAccount token bound to a pod")
    names = (k8s.get("namespace"), sa.get("name"), pod.get("name"), pod.get("uid"))
    if not all(isinstance(n, str) and n for n in names) or [names[0], names[1]] != parts[2:]:
        raise Refusal(401, "the token is not a ServiceAccount token bound to a pod")
    return Sender(namespace=names[0], service_account=names[1], pod_name=names[2], pod_uid=names[3])
