"""The recovery loop's leadership: a lease row with a fencing token. One UPDATE takes the row when
its lease has expired, or renews it for its holder, comparing with the database's clock (`now()`),
so the replicas' clocks do not matter. The token grows whenever the holder changes."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

_ACQUIRE = text("""
    UPDATE recovery_leader
       SET token = CASE WHEN holder IS NOT DISTINCT FROM :me THEN token ELSE token + 1 END,
           acquired_at = CASE WHEN holder IS NOT DISTINCT FROM :me AND expires_at >= now()
                              THEN acquired_at ELSE now() END,
           holder = :me,
           expires_at = now() + :ttl_ms * interval '1 millisecond'
     WHERE name = :name AND (expires_at < now() OR holder = :me)
    RETURNING token
""")
_SEED = text("""
    INSERT INTO recovery_leader (name, holder, token, acquired_at, expires_at)
    VALUES (:name, :me, 1, now(), now() + :ttl_ms * interval '1 millisecond')
    ON CONFLICT (name) DO NOTHING RETURNING token
""")
_RELEASE = text("UPDATE recovery_leader SET expires_at = now() - interval '1 millisecond' "
                "WHERE name = :name AND holder = :me")
_CURRENT = text("SELECT holder, token, acquired_at, expires_at, expires_at > now() AS live "
                "FROM recovery_leader WHERE name = :name")


def acquire(conn: Connection, name: str, holder: str, ttl_ms: int) -> int | None:
    """The fencing token if this holder now holds the lease, else None."""
    params = {"me": holder, "ttl_ms": ttl_ms, "name": name}
    token = conn.execute(_ACQUIRE, params).scalar()
    if token is None:  # the row may be missing: create it
        token = conn.execute(_SEED, params).scalar()
    return token


def release(conn: Connection, name: str, holder: str) -> None:
    conn.execute(_RELEASE, {"me": holder, "name": name})


def current(conn: Connection, name: str) -> dict[str, Any] | None:
    row = conn.execute(_CURRENT, {"name": name}).first()
    return None if row is None else dict(row._mapping)
