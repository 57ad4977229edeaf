"""Reads of a sink's record over HTTP in-process (routes/reads.py): a checkpoint's leases in pages
with their counts by state, what the decided attempt's winners wrote, the open transactions."""

from __future__ import annotations

from fixtures.api_app import SINK, admin, error_of, http, setup_attempt, written  # noqa: F401 - fixtures
from fixtures.servers import ProtocolClient


def test_a_checkpoints_leases_come_in_pages_with_their_counts(admin: ProtocolClient) -> None:
    """A wide batch has a lease per partition and try: the detail lists them by id, a page at a
    time, with the checkpoint's lease count by state and where the next page starts."""
    w, gen, attempt = setup_attempt(admin, partitions=5)
    firsts = [written(w, SINK, 0, attempt, gen, p, p) for p in range(5)]
    retry, _ = written(w, SINK, 0, attempt, gen, 0, 99)  # the loser of partition 0
    assert w.checkpoint(SINK, 0)["records"] is None  # nothing decided yet
    held = w.request("GET", f"/v1/sinks/{SINK}/transactions/open")
    assert sorted(x["lease_id"] for x in held) == sorted([retry["lease_id"], *(x["lease_id"] for x, _ in firsts)])
    assert w.commit(SINK, 0, attempt, gen, {x["partition"]: r for x, r in firsts})["state"] == "COMMITTED"
    every = sorted(x["lease_id"] for x in [*(x for x, _ in firsts), retry])

    listed, after, pages = [], 0, 0
    while after is not None:
        page = w.request("GET", f"/v1/sinks/{SINK}/checkpoints/0", params={"lease_limit": 2, "after_lease_id": after})
        assert page["lease_counts"] == {"ABORTED": 1, "COMMITTED": 5}
        assert [a["number"] for a in page["attempts"]] == [attempt] and page["checkpoint"]["state"] == "COMMITTED"
        assert all(x["attempt"] == attempt for x in page["leases"])
        listed += [x["lease_id"] for x in page["leases"]]
        after, pages = page["next_after_lease_id"], pages + 1
    assert listed == every and pages == 3
    whole = w.checkpoint(SINK, 0)  # the default page holds a thousand
    assert [x["lease_id"] for x in whole["leases"]] == every and whole["next_after_lease_id"] is None
    assert (whole["records"], whole["bytes"]) == (5 * 10, 5 * 1000)  # the winners' sums, not the loser's
    aborted = w.request("GET", f"/v1/sinks/{SINK}/checkpoints/0", params={"lease_state": "ABORTED"})
    assert [x["lease_id"] for x in aborted["leases"]] == [retry["lease_id"]] and aborted["lease_counts"]["COMMITTED"] == 5
    assert w.request("GET", f"/v1/sinks/{SINK}/transactions/open") == []
    for bad in ({"lease_state": "DONE"}, {"lease_state": "PRECOMMITTED"}, {"lease_limit": 0}, {"lease_limit": 1001},
                {"after_lease_id": -1}):
        error_of(w.request("GET", f"/v1/sinks/{SINK}/checkpoints/0", params=bad, expect=None), 422)
