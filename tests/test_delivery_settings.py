"""DeliverySettings: the one declaration of the delivery settings, and its users (dispatcher, server, CLI)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from keyfailover import DeliverySettings, Dispatcher
from keyfailover.broker.server._admin import _setting_value
from keyfailover.broker.server._subscription import SubscriptionConfig
from keyfailover.broker.storage.records import DELIVERY_SETTINGS
from keyfailover.core.errors import ConfigError
from keyfailover.tools.cli import _parser


def test_the_defaults_are_the_servers() -> None:
    settings = DeliverySettings()
    assert (settings.ack_timeout, settings.max_redeliveries, settings.max_replay) == (30.0, None, 100_000)
    assert (settings.max_unacked_per_consumer, settings.nack_backoff, settings.nack_backoff_max) == (50_000, 0.0, 60.0)
    assert SubscriptionConfig().delivery == settings


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"ack_timeout": -1.0}, "ack_timeout must be a finite number >= 0.0 (0 disables leases), not -1.0"),
        ({"ack_timeout": float("nan")}, "ack_timeout must be a finite number >= 0.0"),
        ({"max_redeliveries": True}, "max_redeliveries must be an int >= 0, not True"),
        ({"max_replay": 0}, "max_replay must be an int >= 1, not 0"),
        ({"max_replay": None}, "max_replay must be an int >= 1, not None"),
        ({"max_unacked_per_consumer": 1.5}, "max_unacked_per_consumer must be an int >= 0"),
        ({"nack_backoff": 5.0, "nack_backoff_max": 1.0}, "nack_backoff_max must be a finite number >= 5.0"),
    ],
)
def test_a_value_that_is_not_valid_is_refused_saying_what_was_expected(changes: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        DeliverySettings(**changes)  # type: ignore[arg-type]


def test_overrides_apply_over_the_settings_and_refuse_what_a_subscription_may_not_set() -> None:
    server = DeliverySettings(ack_timeout=10.0, max_unacked_per_consumer=7)
    own = server.with_overrides({"ack_timeout": 1.0, "max_redeliveries": 2})
    assert (own.ack_timeout, own.max_redeliveries, own.max_unacked_per_consumer) == (1.0, 2, 7)
    assert server.ack_timeout == 10.0  # frozen: a new value, the server's unchanged
    with pytest.raises(ConfigError, match=r"unknown delivery settings \['max_unacked_per_consumer'\]"):
        server.with_overrides({"max_unacked_per_consumer": 1})
    with pytest.raises(ConfigError, match=r"unknown delivery settings \['lease'\]"):
        server.with_overrides({"lease": 1.0})
    with pytest.raises(ConfigError, match=r"nack_backoff_max must be a finite number >= 90\.0"):
        server.with_overrides({"nack_backoff": 90.0})


def test_the_settings_a_subscription_may_have_are_those_the_log_stores_and_the_admin_shows() -> None:
    assert set(DELIVERY_SETTINGS) == {
        "ack_timeout",
        "max_redeliveries",
        "nack_backoff",
        "nack_backoff_max",
        "max_replay",
    }
    assert list(DeliverySettings().own_view()) == list(DELIVERY_SETTINGS)


def test_admin_values_are_read_as_each_field_is_typed() -> None:
    assert _setting_value("ack_timeout", "1.5") == 1.5
    assert _setting_value("max_redeliveries", "none") is None
    assert _setting_value("max_redeliveries", "3") == 3
    assert _setting_value("max_replay", "500") == 500
    with pytest.raises(ConfigError, match="max_replay must be a number of messages or default, not 'none'"):
        _setting_value("max_replay", "none")
    with pytest.raises(ConfigError, match="max_redeliveries must be a number of redeliveries, none or default"):
        _setting_value("max_redeliveries", "-1")
    with pytest.raises(ConfigError, match="nack_backoff must be a number of seconds or default, not 'soon'"):
        _setting_value("nack_backoff", "soon")


def test_the_dispatcher_takes_the_settings_or_the_keywords_not_both() -> None:
    settings = DeliverySettings(ack_timeout=2.0, max_redeliveries=1, max_replay=50, max_unacked_per_consumer=4)
    given = Dispatcher(clock=lambda: 0.0, settings=settings)
    assert given.settings == settings and given.max_replay == 50 and given.ack_timeout == 2.0
    keywords = Dispatcher(lambda: 0.0, 50, ack_timeout=2.0, max_redeliveries=1, max_unacked_per_consumer=4)
    assert keywords.settings == settings
    assert Dispatcher(clock=lambda: 0.0).settings == DeliverySettings(ack_timeout=0.0, max_unacked_per_consumer=0)
    with pytest.raises(ConfigError, match="given twice"):
        Dispatcher(clock=lambda: 0.0, settings=settings, ack_timeout=3.0)


def test_a_refused_live_change_changes_nothing() -> None:
    dispatcher = Dispatcher(clock=lambda: 0.0, settings=DeliverySettings(max_unacked_per_consumer=4))
    before = dispatcher.settings
    with pytest.raises(ConfigError, match="max_unacked_per_consumer is 4 for the life of a dispatcher"):
        dispatcher.set_settings(dataclasses.replace(before, ack_timeout=1.0, max_unacked_per_consumer=5))
    with pytest.raises(ConfigError, match=r"nack_backoff_max must be a finite number >= 9\.0"):
        dispatcher.set_delivery_settings(ack_timeout=1.0, max_redeliveries=None, nack_backoff=9.0, nack_backoff_max=1)
    assert dispatcher.settings == before and dispatcher.ack_timeout == before.ack_timeout
    dispatcher.set_delivery_settings(ack_timeout=1.0, max_redeliveries=2)
    assert dispatcher.settings == dataclasses.replace(before, ack_timeout=1.0, max_redeliveries=2)


def test_serve_has_an_option_for_each_setting_with_its_default_and_help() -> None:
    args = _parser().parse_args(["serve", "--data-dir", "d"])
    for declared in DeliverySettings.declared():
        assert getattr(args, declared.name) == declared.default
    shown = _parser().parse_args(["serve", "--data-dir", "d", "--max-replay", "500", "--nack-backoff", "2"])
    assert (shown.max_replay, shown.nack_backoff) == (500, 2.0)
    configure = ["admin", "configure", "--topic", "t", "--subscription", "s", "--max-redeliveries", "none"]
    assert _parser().parse_args(configure).max_redeliveries == "none"  # sent as typed: the server reads it
