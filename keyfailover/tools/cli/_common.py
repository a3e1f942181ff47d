"""What the commands share: the usage error, tokens and TLS, connections, and the parsers of option values."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import ssl
from collections.abc import Callable, Iterator
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode, urlsplit
from urllib.request import Request, urlopen

from keyfailover.core.dispatcher import DeliverySettings
from keyfailover.core.errors import KeyFailoverError

if TYPE_CHECKING:
    from keyfailover.client import Client

Command = Callable[[argparse.Namespace], int]
SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``add_subparsers`` returns: each command module's ``add_*`` adds its command to it."""


def _os_reason(exc: OSError) -> str:
    """Why a connection failed, in words: the resolver's, TLS's or the system's reason."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}" if not isinstance(exc, ssl.SSLCertVerificationError) else str(exc)
    if isinstance(exc, socket.gaierror):
        return str(exc.strerror)
    return os.strerror(exc.errno) if exc.errno else str(exc)


TOKEN_VARIABLE = "KEYFAILOVER_TOKEN"


def _ca_context(args: argparse.Namespace) -> ssl.SSLContext:
    from keyfailover.client.aio import client_tls

    try:
        return client_tls(args.tls_ca)
    except KeyFailoverError as exc:
        raise SystemExit(f"keyfailover {args.command}: {exc}") from None


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token, --token-file or $KEYFAILOVER_TOKEN, in that order; None without one."""
    if args.token is not None and args.token_file is not None:
        raise _UsageError("give --token or --token-file, not both")
    if args.token is not None:
        found, where = args.token, "--token"
    elif args.token_file is not None:
        try:
            found = Path(args.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise SystemExit(
                f"keyfailover {args.command}: cannot read the token file {args.token_file}: {reason}"
            ) from None
        where = f"the token file {args.token_file}"
    elif TOKEN_VARIABLE in os.environ:
        found, where = os.environ[TOKEN_VARIABLE].strip(), f"${TOKEN_VARIABLE}"
    else:
        return None
    if not found:
        raise _UsageError(f"{where} is empty; expected a token")
    return str(found)


class _UsageError(Exception):
    """Options that do not go together, found after parsing: exit 2 like argparse's own errors."""


@contextlib.contextmanager
def _connected(args: argparse.Namespace) -> Iterator[Client]:
    """A client of ``args.url``; a server that is not there or refuses us is one clear line (exit 1)."""
    from keyfailover.client import Client, ServerError

    try:
        client = Client(args.url, _token(args), tls_ca=args.tls_ca)
    except ServerError as exc:
        raise SystemExit(
            f"keyfailover {args.command}: the server at {args.url} refused the connection: {exc}"
        ) from None
    except OSError as exc:
        reason = _os_reason(exc)
        raise SystemExit(
            f"keyfailover {args.command}: cannot connect to {args.url} ({reason}); is keyfailover serve running there?"
        ) from None
    with client:
        yield client


def _finite_float(text: str, zero: bool) -> float:
    """A finite number > 0, or >= 0 with ``zero`` (``inf`` and ``nan`` are refused)."""
    bound = ">= 0" if zero else "> 0"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
    if not (value >= 0 if zero else value > 0) or not value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """A finite number > 0."""
    return _finite_float(text, zero=False)


def _non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _finite_float(text, zero=True)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


_positive_int = _int_at_least(1)


def _int_between(low: int, high: int, what: str) -> Callable[[str], int]:
    """A parser of ints from ``low`` to ``high``, whose error says ``what`` was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


_port = _int_between(0, 65535, "a port number")  # 0: the system picks a free one


def _frame_size(text: str) -> int:
    """A frame limit the protocol can state: 1 KiB to 4 GiB - 1."""
    value = _positive_int(text)
    if not 1024 <= value <= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"expected a frame size from 1024 to {2**32 - 1} bytes, got {text!r}")
    return value


def _session_seconds(text: str) -> float:
    """A session timeout: finite, from 0.1 s to a day."""
    value = _positive_float(text)
    if not 0.1 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds from 0.1 to 86400, got {text!r}")
    return value


def _reply_seconds(text: str) -> float:
    """How long to wait for an answer: finite, from 0.01 s to an hour."""
    value = _positive_float(text)
    if not 0.01 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0.01 to 3600, got {text!r}")
    return value


_max_ranges = _int_between(1, 65536, "a number of ranges")


def _ack_seconds(text: str) -> float:
    """An ack timeout: 0 (no leases) or finite seconds up to a day."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (0 disables), got {text!r}") from None
    if not 0.0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 (disabled) to 86400, got {text!r}")
    return value


def _or_default(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An admin setting: what ``parse`` accepts, or ``default`` (the server's); kept as the text sent."""

    def check(text: str) -> str:
        if text != "default":
            parse(text)
        return text

    check.__name__ = getattr(parse, "__name__", "setting")
    return check


def _delivery_setting(name: str, *, none: bool = False) -> Callable[[str], Any]:
    """The parser of a delivery setting's option, from its field of :class:`DeliverySettings`: seconds from 0 to
    a day for a float, an int in its ``flag_range`` for an int; with ``none``, also ``none`` for a setting that
    may be None."""
    number, optional = DeliverySettings.value_type(name)
    if number is float:
        return _ack_seconds
    metadata = DeliverySettings.metadata(name)
    low, high = metadata["flag_range"]
    if not (none and optional):
        return _int_between(low, high, metadata["what"])
    parse = _int_between(low, high, f"{metadata['what']} or none")

    def parse_or_none(text: str) -> int | None:
        return None if text == "none" else parse(text)

    parse_or_none.__name__ = parse.__name__
    return parse_or_none


def _server_url(text: str) -> str:
    """A broker URL the client accepts (checked before anything connects)."""
    from keyfailover.client.aio import parse_url

    try:
        parse_url(text)
    except KeyFailoverError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _name(text: str) -> str:
    """A topic, subscription, consumer or producer name the protocol accepts."""
    from keyfailover.wire.protocol import check_name

    try:
        return check_name("a name", text)
    except KeyFailoverError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cluster_url(text: str) -> tuple[str, str]:
    """``zk://HOST:PORT[,HOST:PORT...]/PATH``: the ZooKeeper ensemble and the cluster's root path."""
    from keyfailover.broker.cluster import parse_cluster_url

    try:
        return parse_cluster_url(text)
    except KeyFailoverError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _admin_url(text: str) -> str:
    """``http://HOST:PORT`` (or https) of a server's admin endpoint."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"admin URL {text!r} is malformed ({exc}); expected http://HOST:PORT"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise argparse.ArgumentTypeError(f"admin URL {text!r} is not of the form http://HOST:PORT")
    return text


def _admin_call(args: argparse.Namespace, path: str, query: dict[str, str], method: str = "GET") -> Any:
    """GET (or POST) ``path`` on the admin endpoint, as JSON; any failure is one clear line (exit 1)."""
    target = args.admin_url.rstrip("/") + path + ("?" + urlencode(query) if query else "")
    name = f"keyfailover {args.command}"
    hint = "the admin endpoint is the port given to `keyfailover serve --metrics-port`, not the broker port"
    token = _token(args)
    request = Request(target, headers={} if token is None else {"Authorization": f"Bearer {token}"}, method=method)
    tls = None if args.tls_ca is None else _ca_context(args)
    try:
        with urlopen(request, timeout=10, context=tls) as response:
            return json.load(response)
    except HTTPError as exc:
        raise SystemExit(f"{name}: {target}: {exc.code} {exc.read().decode(errors='replace').strip()}") from None
    except URLError as exc:
        reason = f"cannot reach {target} ({exc.reason})"
        raise SystemExit(f"{name}: {reason}; is the server running with --metrics-port?") from None
    except ValueError as exc:  # a malformed URL, or a body that is not JSON
        raise SystemExit(f"{name}: {target} did not answer with JSON ({exc}); {hint}") from None
    except (HTTPException, OSError) as exc:  # not HTTP at all: e.g. the broker's binary protocol
        raise SystemExit(f"{name}: {target} did not answer as an HTTP admin endpoint ({exc!r}); {hint}") from None


def add_actions(commands: SubParsers, name: str, help: str, actions: str) -> SubParsers:
    """A command of several actions, ``keyfailover NAME ACTION``: the parsers to add each action to.
    ``actions`` is their help; the action chosen is ``NAME_command`` of the arguments."""
    command = commands.add_parser(name, help=help)
    return command.add_subparsers(dest=f"{name}_command", required=True, metavar="ACTION", help=actions)


def token_args(sub: argparse.ArgumentParser, what: str) -> None:
    sub.add_argument(
        "--token", default=None, help=f"{what} (visible in `ps`: prefer --token-file or ${TOKEN_VARIABLE})"
    )
    sub.add_argument("--token-file", default=None, help=f"a file holding {what}")


def tls_ca_arg(sub: argparse.ArgumentParser, scheme: str) -> None:
    sub.add_argument(
        "--tls-ca", default=None, help=f"with {scheme} URLs: the CA certificates (PEM) to trust (default: the system's)"
    )
