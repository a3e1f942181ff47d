"""Reading one admin path of many brokers at once (``cluster status``, the chaos harness).

Each broker is asked on its own thread and all answers are waited for until one shared
deadline, so a broker that accepts connections but never answers (SIGSTOPped, a frozen VM, a
lossy link) costs the time limit once however many there are, and delays no other's answer.
"""

from __future__ import annotations

import queue
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http.client import HTTPException
from typing import TypeVar
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

__all__ = ["Answer", "read_each"]

K = TypeVar("K")


@dataclass(frozen=True)
class Answer:
    """What one endpoint gave: the body of its answer, or why there is none."""

    body: bytes | None = None
    failure: str = ""
    """``URL: reason``, when there is no body."""
    answered: bool = True
    """False when nothing answered at all: refused, reset, or silent until the time limit."""


def read_each(
    requests: Mapping[K, Request | str], timeout: float, context: ssl.SSLContext | None = None
) -> dict[K, Answer]:
    """Each request's answer, all sent at once and all waited for at most ``timeout`` seconds in all.

    A request still unanswered at the deadline is left to its daemon thread (its socket gives up
    after ``timeout`` too) and counted as not answering.
    """
    answers: queue.SimpleQueue[tuple[K, Answer]] = queue.SimpleQueue()

    def ask(key: K, request: Request | str) -> None:
        answers.put((key, _read(request, timeout, context)))

    deadline = time.monotonic() + timeout
    for key, request in requests.items():
        threading.Thread(target=ask, args=(key, request), name=f"read {_url(request)}", daemon=True).start()
    found: dict[K, Answer] = {}
    while len(found) < len(requests):
        try:
            key, answer = answers.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            break
        found[key] = answer
    return {key: found.get(key) or _silent(request, timeout) for key, request in requests.items()}


def _url(request: Request | str) -> str:
    return request.full_url if isinstance(request, Request) else request


def _silent(request: Request | str, timeout: float) -> Answer:
    return Answer(failure=f"{_url(request)}: no answer within {timeout:g} s", answered=False)


def _read(request: Request | str, timeout: float, context: ssl.SSLContext | None) -> Answer:
    """One request's answer: a body, an HTTP error or a refusal, a connection that failed or stayed silent."""
    url = _url(request)
    try:
        with urlopen(request, timeout=timeout, context=context) as response:
            body: bytes = response.read()
    except HTTPError as exc:
        exc.close()
        return Answer(failure=f"{url}: HTTP {exc.code} {exc.reason}")
    except URLError as exc:
        if isinstance(exc.reason, OSError):
            return _failed(request, exc.reason, timeout)
        return Answer(failure=f"{url}: {exc.reason}")
    except OSError as exc:  # a timeout or a reset while reading; RemoteDisconnected too
        return _failed(request, exc, timeout)
    except HTTPException as exc:  # something answered, but not HTTP (e.g. the broker's own port)
        return Answer(failure=f"{url}: not an HTTP answer ({exc!r})")
    return Answer(body=body)


def _failed(request: Request | str, error: OSError, timeout: float) -> Answer:
    """A connection that failed: silence until ``timeout``, a refusal, a reset, or TLS (which did answer)."""
    if isinstance(error, TimeoutError):
        return _silent(request, timeout)
    if isinstance(error, ssl.SSLError):
        return Answer(failure=f"{_url(request)}: TLS: {error.reason or error}")
    return Answer(failure=f"{_url(request)}: {error.strerror or error}", answered=False)
