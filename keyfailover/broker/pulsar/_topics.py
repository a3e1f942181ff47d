"""Pulsar topic names to keyfailover topic names, one to one.

``persistent://public/default/NAME`` is the keyfailover topic ``NAME``, and
``persistent://TENANT/NAMESPACE/NAME`` (another tenant or namespace) is ``TENANT/NAMESPACE/NAME``;
NAME holds no ``/``. Back: a keyfailover topic without ``/`` is in ``public/default``, one
with exactly two is ``persistent://`` + its name, other ones have no Pulsar name. A
partition ``NAME-partition-N`` keeps its suffix, which is keyfailover's partition naming too.
"""

from __future__ import annotations

from typing import Final

from keyfailover.core.errors import KeyFailoverError
from keyfailover.wire.protocol import MAX_NAME_LENGTH, is_valid_name

__all__ = ["TopicNameError", "keyfailover_topic", "pulsar_topic"]

_DEFAULT_NAMESPACE: Final = "public/default/"


class TopicNameError(KeyFailoverError, ValueError):
    """A Pulsar topic name keyfailover does not serve; the text says what was expected."""


def keyfailover_topic(name: str) -> str:
    """The keyfailover topic of the Pulsar topic ``name`` (see the module's rule)."""
    if not isinstance(name, str):  # protobuf hands over a string field that is not UTF-8 as bytes
        raise TopicNameError(f"topic name {name!r:.80} is not valid UTF-8")
    scheme, sep, path = name.partition("://")
    if not sep:
        raise TopicNameError(f"topic {name!r:.80} has no scheme; expected persistent://TENANT/NAMESPACE/NAME")
    if scheme != "persistent":
        raise TopicNameError(
            f"topic {name!r:.80} is {scheme}; keyfailover stores every message, expected persistent://"
            "TENANT/NAMESPACE/NAME"
        )
    parts = path.split("/")
    if len(parts) != 3 or not all(parts):
        raise TopicNameError(
            f"topic {name!r:.80} must be persistent://TENANT/NAMESPACE/NAME with three non-empty parts and no '/' "
            "in NAME"
        )
    topic = parts[2] if path.startswith(_DEFAULT_NAMESPACE) else path
    if not is_valid_name(topic):
        raise TopicNameError(
            f"topic {name!r:.80} maps to the keyfailover topic {topic!r:.80}, which is not 1 to {MAX_NAME_LENGTH} "
            "characters without NUL"
        )
    return topic


def pulsar_topic(topic: str) -> str | None:
    """The Pulsar name of the keyfailover topic ``topic`` (see the module's rule); None when it has none."""
    parts = topic.split("/")
    if len(parts) == 1:
        return "persistent://" + _DEFAULT_NAMESPACE + topic
    if len(parts) == 3 and all(parts):
        return "persistent://" + topic
    return None
