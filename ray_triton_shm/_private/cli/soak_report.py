"""What the fault soak reads and reports: the front door of a Serve config, faults, counts, verdict.

Pure Python (no Ray): :func:`front_door` reads the ports a client is told to
use from a Serve config file; :class:`FaultSoakReport` holds the callers'
counts, the faults and the leftovers; :func:`judge` lists every reason the run
failed (see :mod:`~ray_triton_shm._private.cli.soak_faults`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ray_triton_shm.errors import ConfigError

FAULTS = ("replica", "node-actor", "triton")
"""What the soak can kill: a Serve replica, the node actor, the node's Triton."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontDoor:
    """Where external clients are told to connect.

    Attributes:
        host: Address the callers connect to.
        http_port: KServe v2 over HTTP.
        grpc_port: KServe v2 over gRPC (None: the app serves no gRPC).
        route_prefix: The application's HTTP route prefix.
        app: The application's name (sent as gRPC's ``application`` header).

    Raises:
        ConfigError: A port is not a TCP port.
    """

    host: str
    http_port: int
    grpc_port: int | None
    route_prefix: str = "/"
    app: str = ""

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ConfigError(f"{name} must be a TCP port, got {port}")

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}{self.route_prefix.rstrip('/')}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def protocols(self) -> tuple[str, ...]:
        return ("http", "grpc") if self.grpc_port else ("http",)


def front_door(
    config_file: str,
    *,
    host: str | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    app: str | None = None,
) -> FrontDoor:
    """The ports a client is told to use: the config's, unless given here.

    The app's front door (its ``frontdoor`` arg: the replicas' own listeners) where
    the config opens one; otherwise Serve's proxies (``http_options.port``, and
    ``grpc_options.port`` when ``grpc_options`` names a servicer).

    Raises:
        ConfigError: The file has no such application, or a port is invalid.
    """
    spec = yaml.safe_load(Path(config_file).read_text()) or {}
    http = spec.get("http_options") or {}
    grpc = spec.get("grpc_options") or {}
    chosen = [a for a in spec.get("applications") or [] if app is None or a.get("name") == app]
    if not chosen:
        raise ConfigError(f"{config_file}: no application" + (f" named {app!r}" if app else ""))
    bind = str(http.get("host", "127.0.0.1"))
    http_default: int | None = int(http.get("port", 8000))
    grpc_default = int(grpc.get("port", 9000)) if grpc.get("grpc_servicer_functions") else None
    prefix = chosen[0].get("route_prefix", "/") or "/"
    door = (chosen[0].get("args") or {}).get("frontdoor")
    if door:  # the replicas' own listeners: no route prefix there
        bind = str(door.get("host", "127.0.0.1"))
        http_default, grpc_default, prefix = door.get("http_port"), door.get("grpc_port"), "/"
    return FrontDoor(
        host=host or ("127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind),
        http_port=http_port or (int(http_default) if http_default is not None else None),
        grpc_port=grpc_port or (int(grpc_default) if grpc_default is not None else None),
        route_prefix=prefix,
        app=chosen[0].get("name", ""),
    )


@dataclasses.dataclass
class Fault:
    """One fault: what was killed, when, and how the app came back."""

    target: str
    pid: int = -1
    command: str = ""
    injected_at: float | None = None
    gone: bool = False
    replaced_by: int | None = None
    recovered_at: float | None = None
    note: str = ""

    @property
    def recovery_s(self) -> float | None:
        if self.injected_at is None or self.recovered_at is None:
            return None
        return self.recovered_at - self.injected_at


@dataclasses.dataclass
class Window:
    """What the callers got between two faults (or before the first, or after the last)."""

    label: str
    start: float
    end: float
    correct: dict[str, int]
    errors: dict[str, int]


@dataclasses.dataclass
class FaultSoakReport:
    """What a fault soak did; :attr:`problems` empty means it passed."""

    front_door: FrontDoor
    callers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    faults: list[Fault] = dataclasses.field(default_factory=list)
    began: float = 0.0
    ended: float = 0.0
    windows: list[Window] = dataclasses.field(default_factory=list)
    slots_not_returned: dict[str, int] = dataclasses.field(default_factory=dict)
    leftover_segments: list[str] = dataclasses.field(default_factory=list)
    leftover_processes: list[str] = dataclasses.field(default_factory=list)
    stale_segments_of_others: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def total(self, key: str, protocol: str | None = None) -> int:
        """``requests``, ``correct`` or ``wrong`` summed over the callers (of ``protocol``)."""
        return sum(c[key] for c in self.callers if protocol in (None, c["protocol"]))

    def errors(self, protocol: str | None = None) -> dict[str, int]:
        """Errors by class, summed over the callers (of ``protocol``)."""
        merged: dict[str, int] = {}
        for c in self.callers:
            if protocol in (None, c["protocol"]):
                for kind, n in c["errors"].items():
                    merged[kind] = merged.get(kind, 0) + n
        return dict(sorted(merged.items()))

    def untyped(self) -> dict[str, int]:
        """Errors not in Triton's shape, by class."""
        return {kind: n for kind, n in self.errors().items() if kind.startswith("untyped")}

    def summary(self) -> str:
        """The counts, the faults, what each fault cost, and the leftovers, as lines of text."""
        door = self.front_door
        lines = [
            f"front door: HTTP {door.http_url}"
            + (f", gRPC {door.grpc_url}" if door.grpc_port else "")
            + f"; {len(self.callers)} caller processes for {self.ended - self.began:.0f} s"
        ]
        for protocol in door.protocols:
            lines.append(
                f"  {protocol}: {self.total('requests', protocol)} requests, "
                f"{self.total('correct', protocol)} correct, {self.total('wrong', protocol)} wrong, "
                f"errors {self.errors(protocol)}"
            )
        lines.append(
            f"  all: {self.total('requests')} requests, {self.total('correct')} correct, "
            f"{sum(self.errors().values())} errors ({sum(self.untyped().values())} not in Triton's shape), "
            f"{self.total('wrong')} wrong"
        )
        for fault in self.faults:
            at = f"+{fault.injected_at - self.began:.1f} s" if fault.injected_at else "never"
            back = f"{fault.recovery_s:.1f} s" if fault.recovery_s is not None else "never"
            lines.append(
                f"  fault {fault.target}: SIGKILL pid {fault.pid} ({fault.command}) at {at}, "
                f"gone={fault.gone}, replaced by pid {fault.replaced_by}, "
                f"answering again after {back} {fault.note}".rstrip()
            )
        for w in self.windows:
            lines.append(f"  {w.label} ({w.end - w.start:.0f} s): correct {w.correct}, errors {w.errors}")
        shown: dict[str, str] = {}
        for c in self.callers:
            for kind, samples in c["samples"].items():
                shown.setdefault(kind, f"({c['protocol']}) " + " ".join(samples[0].split())[:300])
        lines.extend(f"  e.g. {kind}: {text}" for kind, text in sorted(shown.items()))
        lines.append(f"  slots not returned: {self.slots_not_returned or 'none'}")
        lines.append(f"  left in /dev/shm: {self.leftover_segments or 'nothing'}")
        lines.append(f"  processes left: {self.leftover_processes or 'none'}")
        if self.stale_segments_of_others:
            lines.append(
                f"  (stale segments of other owners, not this run's: {self.stale_segments_of_others})"
            )
        lines.append("PASSED" if not self.problems else "FAILED: " + "; ".join(self.problems))
        return "\n".join(lines)


def _window(callers: Sequence[dict[str, Any]], label: str, start: float, end: float) -> Window:
    correct: dict[str, int] = {}
    errors: dict[str, int] = {}
    for c in callers:
        n = sum(
            v for second, v in c["correct_by_second"].items() if start < int(second) + 1 and int(second) < end
        )
        correct[c["protocol"]] = correct.get(c["protocol"], 0) + n
        for at, kind in c["events"]:
            if start <= at < end and kind != "wrong":
                errors[kind] = errors.get(kind, 0) + 1
    return Window(label, start, end, dict(sorted(correct.items())), dict(sorted(errors.items())))


def judge(report: FaultSoakReport, faults: Sequence[str]) -> None:
    """Fill in ``report.windows`` and ``report.problems``: every reason the run failed."""
    problems = report.problems
    injected = [f for f in report.faults if f.injected_at is not None]
    times = [report.began, *(f.injected_at or 0.0 for f in injected), report.ended]
    labels = ["before the faults", *(f"after the {f.target} fault" for f in injected)]
    report.windows = [
        _window(report.callers, label, start, end)
        for label, (start, end) in zip(labels, itertools.pairwise(times))
    ]
    if report.total("wrong"):
        problems.append(f"{report.total('wrong')} wrong answers")
    if report.untyped():
        problems.append(f"errors not in Triton's shape: {report.untyped()}")
    if [f.target for f in injected] != list(faults):
        problems.append(f"faults injected: {[f.target for f in injected]} of {list(faults)}")
    for fault in report.faults:
        if not fault.gone or fault.recovered_at is None:
            problems.append(
                f"fault {fault.target}: gone={fault.gone}, "
                f"recovered={fault.recovered_at is not None} {fault.note}".rstrip()
            )
    for window in report.windows:
        for protocol in report.front_door.protocols:
            if not window.correct.get(protocol):
                problems.append(f"no correct {protocol} answer {window.label}")
    if report.slots_not_returned:
        problems.append(f"slots not returned: {report.slots_not_returned}")
    if report.leftover_segments:
        problems.append(f"{len(report.leftover_segments)} segments left in /dev/shm")
    if report.leftover_processes:
        problems.append(f"{len(report.leftover_processes)} processes outlived the app")
