"""What a sink's configuration must satisfy (coordinator/protocol/configuration.py): names,
prefixes and the ids made from them, and the time bounds that keep I4 and "no quick reuse" (the
commit reach, the commit margin, the quarantine). Pure: no database, no clock."""

from __future__ import annotations

import pytest

from coordinator.protocol import configuration as config
from coordinator.protocol import errors as e
from fixtures.protocol_records import reason_of

DEFAULT_REACH = config.CommitReach(request_timeout_ms=4_000, retry_budget_ms=8_000, leader_ttl_ms=6_000,
                                   recovery_interval_ms=2_000)


# --- sinks, prefixes, transactional ids -------------------------------------------------------


@pytest.mark.parametrize("prefix", ["a", "orders-eos", "A.b_c-1", "x" * config.MAX_PREFIX_LENGTH])
def test_validate_prefix_accepts(prefix):
    config.validate_prefix(prefix)


@pytest.mark.parametrize("prefix", ["", "has space", "slash/", "ünï", "x" * (config.MAX_PREFIX_LENGTH + 1), "a\n"])
def test_validate_prefix_rejects(prefix):
    with pytest.raises(e.Invalid) as exc:
        config.validate_prefix(prefix)
    assert exc.value.reason == "invalid_transactional_id_prefix"


@pytest.mark.parametrize("name", ["", "-leading", ".x", "a b", "x" * (config.MAX_NAME_LENGTH + 1), "orders\n"])
def test_validate_sink_name_rejects(name):
    with pytest.raises(e.Invalid) as exc:
        config.validate_sink_name(name)
    assert exc.value.reason == "invalid_sink_name"


def test_validate_sink_name_accepts():
    config.validate_sink_name("orders.eos_1-a")
    config.validate_sink_name("x" * config.MAX_NAME_LENGTH)


@pytest.mark.parametrize(
    "a,b,clash",
    [
        ("orders", "orders", True),
        ("orders", "orders-eu", True),
        ("orders-eu", "orders", True),
        ("orders", "order", True),
        ("orders-a", "orders-b", False),
        ("a", "b", False),
        ("xorders", "orders", False),
    ],
)
def test_prefixes_clash(a, b, clash):
    assert config.prefixes_clash(a, b) is clash


def test_transactional_id_for():
    assert config.transactional_id_for("orders", 7) == "orders-7"
    # a prefix ending in a separator is not given a second one ("demo-0", not "demo--0")
    assert config.transactional_id_for("demo-", 0) == "demo-0"
    assert config.transactional_id_for("app.", 3) == "app.3"
    assert config.transactional_id_for("app_", 3) == "app_3"
    assert config.transactional_id_stem("demo-") == config.transactional_id_stem("demo") == "demo-"


@pytest.mark.parametrize("prefix", ["orders", "demo-", "app.", "x_"])
@pytest.mark.parametrize("ordinal", [0, 1, 9, 10, 4095, 123_456])
def test_ordinal_of_reads_back_every_id_of_the_pool(prefix, ordinal):
    assert config.ordinal_of(prefix, config.transactional_id_for(prefix, ordinal)) == ordinal


@pytest.mark.parametrize(
    "transactional_id",
    [
        "orders",  # the prefix alone
        "orders-",  # the stem alone
        "orders-07",  # not how the pool spells 7: another producer's id
        "orders-+7",
        "orders--7",
        "orders-7a",
        "orders-eu-1",  # another sink's (clashing prefixes are refused, yet the broker may hold such ids)
        "other-1",
        "xorders-1",
        "orders-1 ",
        "orders-٣",  # a digit, but not an ASCII one
        "orders-²",  # str.isdigit() says yes, int() says no
    ],
)
def test_ordinal_of_answers_none_for_an_id_that_is_not_of_the_pool(transactional_id):
    """The lingering sweep maps every id a broker lists under the sink's stem to an ordinal to
    quarantine: anything a broker may hold must answer None, never raise."""
    assert config.ordinal_of("orders", transactional_id) is None


# --- timeouts and margins --------------------------------------------------------------------


def test_validate_timeouts():
    config.validate_timeouts(60_000, 6_000, 900_000)
    config.validate_timeouts(900_000, 1, 900_000)  # exactly the broker maximum is fine
    with pytest.raises(e.Invalid) as exc:
        config.validate_timeouts(900_001, 6_000, 900_000)
    assert exc.value.reason == "transaction_timeout_above_broker_max"
    with pytest.raises(e.Invalid) as exc:
        config.validate_timeouts(60_000, 60_000, 900_000)
    assert exc.value.reason == "commit_margin_too_large"
    with pytest.raises(e.Invalid) as exc:
        config.validate_timeouts(60_000, 70_000, 900_000)
    assert exc.value.reason == "commit_margin_too_large"


def test_validate_timeouts_rejects_a_negative_margin():
    # a negative margin would let the gate decide commits of transactions past their deadline (I4)
    with pytest.raises(e.Invalid) as exc:
        config.validate_timeouts(60_000, -1, 900_000)
    assert exc.value.reason == "commit_margin_negative"
    config.validate_timeouts(60_000, 0, 900_000)  # zero is allowed: the gate still refuses expired ones


@pytest.mark.parametrize(
    "timeout,margin",
    [
        (60_000, 6_000),  # a tenth
        (900_000, 90_000),
        (30_000, 5_000),  # at least 5 s
        (50_000, 5_000),
        (8_000, 4_000),  # but never more than half the timeout
        (1_000, 500),
    ],
)
def test_default_commit_margin_ms(timeout, margin):
    assert config.default_commit_margin_ms(timeout) == margin
    config.validate_timeouts(timeout, margin, 900_000)  # the default always passes validation


# --- the commit reach (I4 across crashes and failovers) --------------------------------------


def test_commit_reach_figures_with_the_default_settings():
    """Request timeout 4 s, retry budget 8 s, leader TTL 6 s, interval 2 s (rebuild: 22 s)."""
    assert DEFAULT_REACH.recovery_grace_ms == 8_000 + 4_000  # retry budget + request timeout
    assert DEFAULT_REACH.retry_window_ms == 6_000 + 2 * 2_000 + 8_000  # TTL + 2 intervals + retry budget
    assert DEFAULT_REACH.total_ms == DEFAULT_REACH.retry_window_ms + 4_000 == 22_000
    assert "= 22000 ms" in DEFAULT_REACH.describe()
    # a 60 s sink's default margin covers the reach plus a request's own latency
    assert config.default_commit_margin_ms(60_000, DEFAULT_REACH) == 22_000 + config.REACH_SLACK_MS == 25_000
    config.validate_commit_reach(60_000, 25_000, DEFAULT_REACH)
    config.validate_timeouts(60_000, 25_000, 900_000)


def test_commit_reach_figures_follow_each_setting():
    # distinct powers of ten, so each setting's share of each figure is visible
    reach = config.CommitReach(request_timeout_ms=1, retry_budget_ms=10, leader_ttl_ms=100, recovery_interval_ms=1_000)
    assert reach.recovery_grace_ms == 11
    assert reach.retry_window_ms == 2_110  # a failover's pass (TTL + interval), an interval, a retry budget
    assert reach.total_ms == 2_111
    # a request timeout longer than a failover: the window waits for the loop's first look instead
    slow = config.CommitReach(request_timeout_ms=5_000, retry_budget_ms=10, leader_ttl_ms=100,
                              recovery_interval_ms=1_000)
    assert slow.recovery_grace_ms == 5_010 and slow.retry_window_ms == 6_010 and slow.total_ms == 11_010


@pytest.mark.parametrize("request_timeout_ms", [1_000, 4_000, 30_000])
@pytest.mark.parametrize("retry_budget_ms", [0, 8_000])
@pytest.mark.parametrize("leader_ttl_ms", [2_001, 6_000, 60_000])
@pytest.mark.parametrize("recovery_interval_ms", [500, 2_000])
def test_every_finisher_gets_its_chance_inside_the_window(request_timeout_ms, retry_budget_ms, leader_ttl_ms,
                                                           recovery_interval_ms):
    """Whatever the settings: the recovery loop's first look at an orphaned decision (after the
    deciding call's grace, within an interval) comes before the window ends, and a failed-over
    loop's pass (TTL + interval) plus an interval still leaves it a whole retry budget."""
    reach = config.CommitReach(request_timeout_ms, retry_budget_ms, leader_ttl_ms, recovery_interval_ms)
    assert reach.recovery_grace_ms + recovery_interval_ms <= reach.retry_window_ms
    assert reach.retry_window_ms >= leader_ttl_ms + 2 * recovery_interval_ms + retry_budget_ms
    assert reach.total_ms == reach.retry_window_ms + request_timeout_ms


def test_validate_commit_reach_names_the_numbers():
    with pytest.raises(e.Invalid) as exc:
        config.validate_commit_reach(60_000, 22_000, DEFAULT_REACH)  # equal to the reach: not above it
    assert reason_of(exc) == "commit_margin_below_commit_reach"
    assert exc.value.detail["commit_reach_ms"] == 22_000 and exc.value.detail["commit_margin_ms"] == 22_000
    assert "commit_margin_ms >= 25000" in exc.value.message
    config.validate_commit_reach(60_000, 22_001, DEFAULT_REACH)
    # a timeout that leaves no room above the reach plus its slack
    with pytest.raises(e.Invalid) as exc:
        config.validate_commit_reach(25_000, 24_000, DEFAULT_REACH)
    assert reason_of(exc) == "transaction_timeout_below_commit_reach"
    config.validate_commit_reach(25_001, 24_000, DEFAULT_REACH)


# --- the quarantine (no quick reuse) ---------------------------------------------------------


def test_validate_quarantine():
    config.validate_quarantine(150_001, 30_000, 60_000, 60_000)
    with pytest.raises(e.Invalid) as refused:
        config.validate_quarantine(150_000, 30_000, 60_000, 60_000)  # equal to what a try can reach: too short
    assert reason_of(refused) == "transactional_id_quarantine_too_short"


def test_validate_quarantine_covers_the_coordinators_own_abort_reach():
    # two finishers may abort one lease; the later abort must not fence the id's next lease
    config.validate_quarantine(180_000, 30_000, 60_000, 60_000, abort_reach_ms=179_999)
    with pytest.raises(e.Invalid) as refused:
        config.validate_quarantine(180_000, 30_000, 60_000, 60_000, abort_reach_ms=180_000)
    assert reason_of(refused) == "transactional_id_quarantine_too_short"
    assert "abort reach (180000)" in refused.value.message
