"""The README's configuration table lists every config field with its env var and default."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from ray_triton_shm._private.serve.door.frontdoor_config import FrontDoorConfig
from ray_triton_shm.config import ClientConfig, PoolConfig, ServerConfig
from ray_triton_shm.node import NodeConfig

README = Path(__file__).resolve().parents[2] / "README.md"
CLASSES = (ServerConfig, PoolConfig, ClientConfig, NodeConfig, FrontDoorConfig)
_ROW = re.compile(r"^\|\s*`(\w+)\.(\w+)`\s*\|([^|]*)\|([^|]*)\|([^|]*)\|\s*$")


def _rows() -> dict[str, tuple[str, str]]:
    text = README.read_text()
    start, end = text.index("<!-- config-table:start -->"), text.index("<!-- config-table:end -->")
    rows = {}
    for line in text[start:end].splitlines():
        match = _ROW.match(line)
        if match:
            key = f"{match.group(1)}.{match.group(2)}"
            assert key not in rows, f"{key} appears twice in the README table"
            rows[key] = (match.group(3).strip(), match.group(4).strip())
    return rows


def _defaults(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    for name in list(os.environ):
        if name.startswith("RAY_TRITON_SHM_"):
            monkeypatch.delenv(name)
    server = ServerConfig(model_repository="unused")
    instances = (
        server,
        PoolConfig(),
        ClientConfig(),
        NodeConfig(server=server),
        FrontDoorConfig(http_port=0),
    )
    defaults = {
        f"{type(o).__name__}.{f.name}": getattr(o, f.name) for o in instances for f in dataclasses.fields(o)
    }
    # A front door needs a port: the one given above is not the field's default.
    defaults["FrontDoorConfig.http_port"] = dataclasses.fields(FrontDoorConfig)[1].default_factory()
    return defaults


def _canonical(value: object) -> str | None:
    """How a default is written in the table's default column (None: not checked)."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None or isinstance(value, (int, float)):
        return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"
    if isinstance(value, str):
        return "`" + value.replace(os.path.expanduser("~"), "~", 1) + "`"
    if isinstance(value, (tuple, dict)) and not value:
        return f"`{value!r}`"
    if isinstance(value, PoolConfig) and value == PoolConfig():
        return "`PoolConfig()`"
    return None  # nested required configs


def _fields() -> dict[str, dataclasses.Field]:
    return {f"{cls.__name__}.{f.name}": f for cls in CLASSES for f in dataclasses.fields(cls)}


def test_every_field_has_exactly_one_row() -> None:
    rows, fields = _rows(), _fields()
    missing = sorted(set(fields) - set(rows))
    extra = sorted(set(rows) - set(fields))
    assert not missing, f"add rows to README's configuration table for: {missing}"
    assert not extra, f"README's configuration table has rows for fields that do not exist: {extra}"


def test_env_vars_match() -> None:
    rows = _rows()
    for key, f in _fields().items():
        env = f.metadata.get("env")
        want = f"`{env}`" if env else "—"
        assert rows[key][0] == want, f"README row {key}: env var column should be {want}"


def test_defaults_match(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _rows()
    for key, value in _defaults(monkeypatch).items():
        if key in ("ServerConfig.model_repository", "NodeConfig.server"):
            assert rows[key][1] == "required"
            continue
        want = _canonical(value)
        assert want is not None, f"no canonical form for the default of {key}: {value!r}"
        assert rows[key][1].startswith(want), f"README row {key}: default should start with {want}"


def test_serve_args_table_names_every_key_the_app_reads() -> None:
    """Every NodeConfig setting is a Serve arg, beside the repository, server, pools and client keys."""
    text = README.read_text()
    start, end = text.index("<!-- serve-args:start -->"), text.index("<!-- serve-args:end -->")
    named = set()
    for line in text[start:end].splitlines():
        if line.startswith("| `"):
            named.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    node_fields = {f.name for f in dataclasses.fields(NodeConfig)} - {"server", "pools", "default_pool"}
    app_keys = {"model_repository", "server", "pools", "default_pool", "slots_per_model", "memory"}
    app_keys |= {"frontdoor"}
    differ = sorted(named ^ (node_fields | app_keys))
    assert not differ, f"README's Serve args table is wrong about: {differ}"
