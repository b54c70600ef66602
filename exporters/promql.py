"""A small client of Prometheus' HTTP query API: PromQL in, samples out (standard library only).

:meth:`Prometheus.query` is an instant query (``/api/v1/query``, sent as a form POST so a long expression fits); a
vector result comes back as :class:`Sample` rows, a scalar as one row without labels.  Every failure (the server
cannot be reached, answers with an error, or with something that is not its API's JSON) is a :class:`PromQLError`
naming the URL, the expression and what went wrong.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["PromQLError", "Prometheus", "Sample", "check_url", "finite"]

_MAX_REPLY = 512 << 20  # a reply larger than this is refused (a 4,096-rank job's biggest answer is a few MiB)


class PromQLError(Exception):
    """A query failed; the message names the server, the expression and the reason."""


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError naming it unless it is an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--prometheus must be an http:// or https:// URL of a Prometheus server (got {url!r})")
    return url.rstrip("/")


class Prometheus:
    """The server at ``url`` (``http://host:9090``, or a path prefix behind a proxy)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = check_url(url)
        self.timeout_s = timeout_s

    def query(self, expr: str, *, at: float | None = None) -> list[Sample]:
        """The instant vector (or scalar) ``expr`` evaluates to, at ``at`` (Unix seconds; default: now)."""
        form = {"query": expr, **({} if at is None else {"time": f"{at:.3f}"})}
        data = self._post("/api/v1/query", form, expr)
        kind, result = data.get("resultType"), data.get("result")
        if kind == "vector" and isinstance(result, list):
            return [Sample(dict(r.get("metric", {})), _number(r["value"][1], expr)) for r in result]
        if kind == "scalar" and isinstance(result, list):
            return [Sample({}, _number(result[1], expr))]
        raise PromQLError(f"{self.url}: {expr!r} gave a {kind} result; an instant vector was expected")

    def _post(self, path: str, form: dict[str, str], expr: str) -> dict[str, Any]:
        body = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(self.url + path, data=body, method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read(_MAX_REPLY + 1)
        except urllib.error.HTTPError as exc:  # 400/422/503: the API still answers JSON with an error
            raw = exc.read(_MAX_REPLY + 1)
            message = raw[:200].decode(errors="replace")
            try:
                message = json.loads(raw).get("error") or message
            except (ValueError, AttributeError):
                pass
            raise PromQLError(f"{self.url}: {expr!r} failed: HTTP {exc.code}: {message}") from None
        except (OSError, ValueError) as exc:  # refused, unreachable, timed out, a bad host name
            reason = getattr(exc, "reason", exc)
            raise PromQLError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        if len(raw) > _MAX_REPLY:
            raise PromQLError(f"{self.url}: {expr!r}: the reply is over {_MAX_REPLY >> 20} MiB")
        try:
            reply_json = json.loads(raw)
        except ValueError:
            raise PromQLError(f"{self.url} did not answer as Prometheus' query API does (not JSON: "
                              f"{raw[:80]!r})") from None
        if not isinstance(reply_json, dict) or reply_json.get("status") != "success":
            error = reply_json.get("error") if isinstance(reply_json, dict) else reply_json
            raise PromQLError(f"{self.url}: {expr!r} failed: {error}")
        data = reply_json.get("data")
        if not isinstance(data, dict):
            raise PromQLError(f"{self.url}: {expr!r}: the reply has no data")
        return data


def _number(text: Any, expr: str) -> float:
    try:
        return float(text)  # "NaN", "+Inf" included
    except (TypeError, ValueError):
        raise PromQLError(f"{expr!r}: a sample value is not a number ({text!r})") from None


def finite(value: float | None) -> float | None:
    """``value`` where it is a finite number, else None (a rate over no samples is NaN)."""
    return value if value is not None and math.isfinite(value) else None
