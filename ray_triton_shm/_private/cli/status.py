"""``ray-triton-shm status``: what every node actor of a running Ray cluster reports."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Writer = Callable[[str], None]
_TOKEN_FILE = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def collect(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Ask every node actor of the connected Ray cluster for its status.

    Ray must already be initialised (``ray.init(address=...)``).

    Args:
        timeout_s: How long to wait for each actor.

    Returns:
        One entry per node actor: ``node_ip`` plus the actor's ``status()``
        (``info``, ``models``, ``pools``, ``traffic``), or ``error`` when the
        actor did not answer.
    """
    # lazy: run() sets RAY_AUTH_MODE before Ray is imported (Ray reads it once)
    import ray

    from ray_triton_shm._private.node.node_config import NAME_PREFIX, NAMESPACE
    from ray_triton_shm._private.node.node_lifecycle import node_actor_names

    ips = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    pending = []
    for name in node_actor_names():
        node_id = name[len(NAME_PREFIX) :].rsplit("-", 1)[0]
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            pending.append((node_id, actor.status.remote(), actor.server_warnings.remote()))
        except ValueError:
            continue  # gone between listing and lookup
    nodes = []
    for node_id, ref, warnings_ref in pending:
        entry: dict[str, Any] = {"node_id": node_id, "node_ip": ips.get(node_id, "")}
        try:
            entry.update(ray.get(ref, timeout=timeout_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        try:
            entry["warnings"] = list(ray.get(warnings_ref, timeout=timeout_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            entry["warnings"] = []
        nodes.append(entry)
    return nodes


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]

    # First column left-aligned (names), the rest right-aligned (numbers).
    def line(cells: list[str]) -> str:
        parts = [str(cells[0]).ljust(widths[0])]
        parts += [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return indent + "  ".join(parts).rstrip()

    return [line(header), indent + "-" * (sum(widths) + 2 * (len(widths) - 1)), *(line(r) for r in rows)]


def _health_lines(health: dict[str, Any] | None) -> list[str]:
    """One line on Triton's health (see ``node_health``); none from nodes that do not report it."""
    if not health:
        return []
    line = f"  health {health['state']}"
    if health["state"] != "ok":
        line += f" for {health.get('unready_for_s') or 0:.1f}s"
    if health.get("consecutive_failures"):
        line += f"  consecutive failures {health['consecutive_failures']}"
    if health.get("next_attempt_in_s"):
        line += f"  next restart in {health['next_attempt_in_s']:.1f}s"
    if health.get("last_restart_s") is not None:
        line += f"  last restart took {health['last_restart_s']:.1f}s"
    if health.get("last_error"):
        line += f"  last error: {health['last_error']}"
    return [line]


def _reaper_lines(reaper: dict[str, Any] | None) -> list[str]:
    """One line on the node actor's reaper (it cleans up if the actor dies); none if not reported."""
    if not reaper:
        return []
    line = f"  reaper pid {reaper['pid']} {'ok' if reaper.get('alive') else 'DOWN'}"
    if reaper.get("restarts"):
        line += f"  restarts {reaper['restarts']}"
    if reaper.get("last_failure"):
        line += f"  last failure: {reaper['last_failure']}"
    return [line]


def render(nodes: list[dict[str, Any]]) -> str:
    """A readable report of :func:`collect`'s result."""
    if not nodes:
        return (
            "no Triton node actors in this Ray cluster "
            "(start them with ensure_node_actors(), the Serve app or `ray-triton-shm demo --hold`)"
        )
    out: list[str] = []
    total_bytes = 0
    for node in nodes:
        head = f"node {node['node_id'][:12]}  ({node.get('node_ip') or '?'})"
        if "error" in node:
            out += [head, f"  not answering: {node['error']}", ""]
            continue
        info = node["info"]
        out.append(head)
        for warning in node.get("warnings", []):
            out.append(f"  !!! {warning}")
        out.append(
            f"  Triton {info['version']}  grpc {info['grpc_url']}  http {info['http_url']}  "
            f"metrics {info['metrics_url']}  pid {info['triton_pid']}  restarts {info['restarts']}"
        )
        out += _health_lines(node.get("health"))
        out += _reaper_lines(node.get("reaper"))
        ready = [m["name"] for m in node["models"] if m.get("state") == "READY"]
        other = [
            f"{m['name']} ({m.get('state') or 'not loaded'})"
            for m in node["models"]
            if m.get("state") != "READY"
        ]
        out.append(f"  models ready: {', '.join(ready) or '-'}")
        if other:
            out.append(f"  models not ready: {', '.join(other)}")
        users = node.get("users") or []
        kinds: dict[str, int] = {}
        for user in users:
            kinds[str(user.get("kind", "?"))] = kinds.get(str(user.get("kind", "?")), 0) + 1
        shown = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        idle = node.get("idle_shutdown_s")
        out.append(
            f"  users: {len(users)}"
            + (f" ({shown})" if shown else "")
            + ("" if idle is None else f"; stops {idle:g} s after the last one")
        )
        doors = node.get("frontdoors") or []
        if doors:
            rows = [
                [
                    str(d.get("app", "")),
                    str(d.get("pid", "")),
                    str(d.get("http_port") or "-"),
                    str(d.get("grpc_port") or "-"),
                    str(d.get("connections", 0)),
                    str(d.get("ongoing", 0)),
                    str(d.get("calls", 0)),
                    str(d.get("refused", 0)),
                ]
                for d in doors
            ]
            header = ["front door", "replica pid", "HTTP", "gRPC", "connections", "running", "calls"]
            header.append("refused")
            out += _table(header, rows)
        held = node.get("held_doors") or []
        if held:
            ports = ", ".join(
                f"{h.get('port')} ({h.get('app')}{', no replica on it' if h.get('replicas_away') else ''})"
                for h in held
            )
            out.append(f"  front-door ports held open by the node: {ports}")
        pools = node["pools"]
        if pools:
            rows = [
                [
                    model,
                    str(p["slots"]),
                    str(p["free"]),
                    str(p["in_use"]),
                    str(p["quarantined"]),
                    _size(p["slot_bytes"]),
                ]
                for model, p in sorted(pools.items())
            ]
            out += _table(["pool", "slots", "free", "in use", "quarantined", "slot size"], rows)
        else:
            out.append("  pools: none yet (created on a model's first request)")
        traffic = node["traffic"]
        if traffic:
            rows = [[t["model"], t["path"], str(t["requests"]), _size(t["bytes"])] for t in traffic]
            out += _table(["traffic", "path", "requests", "bytes moved"], rows)
            total_bytes += sum(t["bytes"] for t in traffic)
        else:
            out.append("  traffic: none reported yet")
        out.append("")
    out.append(f"{len(nodes)} node(s), {_size(total_bytes)} moved in all")
    out.append("(busy = slots granted to client processes; bytes = inputs + outputs, as clients report them)")
    return "\n".join(out)


def run(address: str, *, as_json: bool, write: Writer, timeout_s: float = 30.0) -> int:
    """Connect to Ray at ``address``, collect and write the status.

    Returns:
        0, or 1 when some node actor did not answer.

    Raises:
        ConnectionError: No Ray cluster at ``address``.
    """
    if address != "auto" and "RAY_AUTH_MODE" not in os.environ and os.path.exists(_TOKEN_FILE):
        # Ray turns token auth on by itself only for address "auto"; a local cluster
        # started by ray.init() requires it, so use the saved token for explicit addresses too.
        # (Before Ray is imported: it reads the mode once.)
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray  # lazy: RAY_AUTH_MODE above must be set before Ray is imported

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        nodes = collect(timeout_s)
    finally:
        ray.shutdown()
    write(json.dumps(nodes, indent=2, sort_keys=True) if as_json else render(nodes))
    return 1 if any("error" in n for n in nodes) else 0
