"""Tokens: one admin token for sink management and operator actions, and per-sink writer tokens
for the protocol calls of a Spark query.

Writer tokens are derived, not stored: HMAC(secret, sink id, token version). A retried sink
registration therefore returns the same token, rotating a sink's token is a version bump, and the
database holds nothing that authenticates by itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass


@dataclass(frozen=True)
class Principal:
    is_admin: bool
    sink_name: str | None = None  # the sink a writer token belongs to

    @property
    def actor(self) -> str:
        return "admin" if self.is_admin else f"writer:{self.sink_name}"


def writer_token(secret: bytes, sink_id: int, version: int) -> str:
    mac = hmac.new(secret, f"writer:{sink_id}:{version}".encode(), hashlib.sha256).digest()
    return "wt_" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def tokens_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
