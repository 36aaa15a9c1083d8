"""Entitlement decisions without sockets: patterns, Basic, JWT, Custom, address lists."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st

from migratory.entitlement import (
    AddressList,
    BasicEntitlement,
    CustomEntitlement,
    JwtEntitlement,
    subject_matches,
)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("/Stocks/NYSE/IBM", "/Stocks/NYSE/IBM", True),
        ("/Stocks/*/IBM", "/Stocks/NYSE/IBM", True),
        ("/Stocks/*/IBM", "/Stocks/NYSE/MSFT", False),
        ("/Stocks/*", "/Stocks/NYSE/IBM", False),
        ("/Stocks/**", "/Stocks/NYSE/IBM", True),
        ("/Stocks/**", "/Stocks", False),
        ("/Stocks/**", "/Bonds/x", False),
        ("/a/b", "/a/b/c", False),
    ],
)
def test_subject_patterns(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


@given(st.text(max_size=30), st.text(max_size=30))
def test_pattern_matching_never_raises(pattern: str, subject: str) -> None:
    subject_matches(pattern, subject)


def test_basic_entitlement() -> None:
    basic = BasicEntitlement("s3cret")
    assert basic.check_subscribe("", "/a/b", "1.2.3.4") is None
    assert basic.check_publish("s3cret", "/a/b", "1.2.3.4") is None
    decision = basic.check_publish("guess", "/a/b", "1.2.3.4")
    assert decision is not None and decision[0] == "entitlement"


def test_jwt_hs256_permissions_and_expiry() -> None:
    auth = JwtEntitlement("k" * 32, ["HS256"])
    token = jwt.encode({"permissions": {"sub": ["/Stocks/**"], "pub": ["/Orders/*"]}}, "k" * 32, algorithm="HS256")
    assert auth.check_subscribe(token, "/Stocks/NYSE/IBM", "") is None
    assert auth.check_subscribe(token, "/Orders/x", "") is not None
    assert auth.check_publish(token, "/Orders/x", "") is None
    assert auth.expires_at(token) is None
    forged = jwt.encode({"permissions": {"sub": ["/**"]}}, "wrong-key-wrong-key-wrong-key-00", algorithm="HS256")
    decision = auth.check_subscribe(forged, "/a/b", "")
    assert decision is not None and "invalid token" in decision[1]
    assert auth.check_subscribe("not-a-jwt", "/a/b", "") is not None
    assert auth.check_subscribe("", "/a/b", "") == ("entitlement", "no entitlement token")
    soon = time.time() + 1
    short = jwt.encode({"exp": int(soon) + 1, "permissions": {"sub": ["/a/b"]}}, "k" * 32, algorithm="HS256")
    assert auth.check_subscribe(short, "/a/b", "") is None
    assert auth.expires_at(short) == int(soon) + 1
    expired = jwt.encode({"exp": int(time.time()) - 10, "permissions": {"sub": ["/a/b"]}}, "k" * 32, algorithm="HS256")
    assert auth.check_subscribe(expired, "/a/b", "") == ("entitlement", "the token has expired")


def test_jwt_es256_with_public_key() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    auth = JwtEntitlement(public.decode(), ["RS256", "ES256"])
    token = jwt.encode({"permissions": {"sub": ["/a/*"]}}, key, algorithm="ES256")
    assert auth.check_subscribe(token, "/a/b", "") is None
    hs = jwt.encode({"permissions": {"sub": ["/a/*"]}}, "secret-secret-secret-secret-0000", algorithm="HS256")
    assert auth.check_subscribe(hs, "/a/b", "") is not None  # no algorithm confusion


def test_custom_entitlement_is_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rules.py").write_text(
        "class Rules:\n"
        "    def authorize_subscribe(self, token, subject, address):\n"
        "        return subject.startswith('/public/')\n"
        "    def authorize_publish(self, token, subject, address):\n"
        "        raise RuntimeError('backend down')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = CustomEntitlement("my_rules:Rules")
    assert custom.check_subscribe("", "/public/x", "") is None
    assert custom.check_subscribe("", "/private/x", "") is not None
    decision = custom.check_publish("", "/public/x", "")
    assert decision == ("entitlement", "custom entitlement failed: RuntimeError")
    sys.modules.pop("my_rules", None)


def test_address_list() -> None:
    addresses = AddressList(["10.0.0.0/8", "192.168.1.7", "fd00::/8"])
    assert addresses.allows("10.1.2.3") and addresses.allows("192.168.1.7")
    assert addresses.allows("::ffff:10.9.9.9")  # IPv4-mapped, as dual-stack listeners report it
    assert addresses.allows("fd00::1")
    assert not addresses.allows("192.168.1.8") and not addresses.allows("8.8.8.8") and not addresses.allows("junk")
    assert AddressList([]).allows("8.8.8.8")


@given(st.text(max_size=200))
def test_hostile_tokens_get_a_decision_never_an_exception(token: str) -> None:
    auth = JwtEntitlement("k" * 32, ["HS256"])
    decision = auth.check_subscribe(token, "/a/b", "")
    assert decision is not None and decision[0] == "entitlement"
    assert auth.expires_at(token) is None
