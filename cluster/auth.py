"""The bearer-token rule, in one place for the standalone server and the cluster's ingress.

A call is authorized when its ``authorization`` metadata is ``Bearer <token>``. The scheme name
is case-insensitive (RFC 7235, section 2.1); the token is compared in constant time.
"""

from __future__ import annotations

import hmac

__all__ = ["bearer_token_matches"]

_SCHEME = b"bearer"


def bearer_token_matches(metadata, expected_token: str) -> bool:
    """True when ``metadata`` (gRPC key/value pairs) carries ``authorization: Bearer <expected_token>``."""
    expected = expected_token.encode()
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        given = value.encode() if isinstance(value, str) else bytes(value)
        scheme, _, token = given.partition(b" ")
        # compare both parts whatever the scheme, so a wrong scheme costs the same time
        scheme_ok = hmac.compare_digest(scheme.lower(), _SCHEME)
        return hmac.compare_digest(token, expected) and scheme_ok
    return False
