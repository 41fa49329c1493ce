"""Bearer-token auth at the ingress (Serve's gRPC proxy has none)."""

from __future__ import annotations

import grpc
import pytest

from dspine.cluster.errors import UnauthenticatedError, status_for
from dspine.cluster.ingress import check_bearer


def test_no_token_configured_lets_everything_through():
    check_bearer([], None)
    check_bearer([("authorization", "Bearer whatever")], "")


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong")], [("authorization", "secret")],
                                      [("x-other", "Bearer secret")]], ids=["none", "wrong", "no-scheme", "other-key"])
def test_missing_or_wrong_token_is_unauthenticated(metadata):
    with pytest.raises(UnauthenticatedError) as info:
        check_bearer(metadata, "secret")
    assert status_for(info.value)[0] is grpc.StatusCode.UNAUTHENTICATED


def test_right_token_passes_in_any_key_case():
    check_bearer([("application", "dspine"), ("Authorization", "Bearer secret")], "secret")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_scheme_name_is_case_insensitive(scheme):
    check_bearer([("authorization", f"{scheme} secret")], "secret")  # RFC 7235: schemes are case-insensitive


@pytest.mark.parametrize("value", ["Basic secret", "Bearer secret2", "Bearersecret", "Bearer  secret"])
def test_other_schemes_and_near_tokens_are_refused(value):
    with pytest.raises(UnauthenticatedError):
        check_bearer([("authorization", value)], "secret")
