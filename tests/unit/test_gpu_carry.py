"""tools/gpu/carry.py: the GPU kit's parts, on small synthetic files (no downloads, no device)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_carry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_carry", REPO / "tools" / "gpu" / "carry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


carry = _load_carry()


def _archive(tmp_path: Path, size: int, seed: int = 0) -> Path:
    path = tmp_path / "site.tar.xz"
    path.write_bytes(bytes((i * 7 + seed) % 251 for i in range(size)))
    return path


@pytest.mark.parametrize(
    "size, part", [(10_000, 3_000), (9_000, 3_000), (1, 3_000), (0, 3_000), (3 * 1024, 1024)]
)
def test_parts_fit_the_limit_and_join_back_to_the_same_bytes(tmp_path: Path, size: int, part: int) -> None:
    archive = _archive(tmp_path, size)
    out = tmp_path / "carry"
    manifest = carry.split(archive, out, part)
    parts = sorted(out.glob("part-*"))
    assert [p.name for p in parts] == [entry["name"] for entry in manifest["parts"]]
    assert len(parts) == max(1, -(-size // part))
    assert all(p.stat().st_size <= part for p in parts)
    assert sum(p.stat().st_size for p in parts) == size
    # The manifest names every part with its size and digest, and the whole archive.
    stored = json.loads((out / carry.MANIFEST).read_text())
    assert stored == manifest
    assert stored["bytes"] == size and stored["sha256"] == carry.sha256_of(archive)
    for entry, path in zip(stored["parts"], parts, strict=True):
        assert entry["bytes"] == path.stat().st_size and entry["sha256"] == carry.sha256_of(path)
    stash = tmp_path / "stash"
    carry.stash(out, stash)
    joined = tmp_path / "joined.tar.xz"
    carry.join(stash, joined)
    assert joined.read_bytes() == archive.read_bytes()


def test_parts_arrive_one_call_at_a_time(tmp_path: Path) -> None:
    """Each call carries the manifest and one part; the stash keeps what came, join waits for the rest."""
    archive = _archive(tmp_path, 7_000, seed=3)
    packed = tmp_path / "packed"
    manifest = carry.split(archive, packed, 2_500)
    names = [entry["name"] for entry in manifest["parts"]]
    assert len(names) == 3
    stash = tmp_path / "stash"
    for n, name in enumerate(names):
        call = tmp_path / f"call{n}"  # what one call brings: the manifest and one part
        call.mkdir()
        (call / carry.MANIFEST).write_bytes((packed / carry.MANIFEST).read_bytes())
        (call / name).write_bytes((packed / name).read_bytes())
        have = carry.stash(call, stash)
        assert have == names[: n + 1]
        assert carry.missing_parts(stash) == names[n + 1 :]
        if n < len(names) - 1:
            with pytest.raises(carry.CarryError, match=r"have not arrived yet") as waiting:
                carry.join(stash, tmp_path / "joined")
            assert all(missing in str(waiting.value) for missing in names[n + 1 :])
    carry.join(stash, tmp_path / "joined")
    assert (tmp_path / "joined").read_bytes() == archive.read_bytes()


def test_a_corrupted_or_short_part_is_named_and_nothing_is_joined(tmp_path: Path) -> None:
    archive = _archive(tmp_path, 5_000)
    out = tmp_path / "carry"
    carry.split(archive, out, 2_000)
    damaged = bytearray((out / "part-01").read_bytes())
    damaged[10] ^= 0xFF
    (out / "part-01").write_bytes(bytes(damaged))
    with pytest.raises(carry.CarryError, match="part part-01 is corrupted"):
        carry.stash(out, tmp_path / "stash")
    (out / "part-01").write_bytes(bytes(damaged[:-1]))
    with pytest.raises(carry.CarryError, match="part part-01 holds 1999 bytes"):
        carry.stash(out, tmp_path / "stash2")
    # A part damaged after it was stashed is caught when joining, and no archive is left.
    carry.split(archive, out, 2_000)
    stash = tmp_path / "stash3"
    carry.stash(out, stash)
    (stash / "part-02").write_bytes(b"x" * (stash / "part-02").stat().st_size)
    joined = tmp_path / "joined"
    with pytest.raises(carry.CarryError, match="part part-02 is corrupted"):
        carry.join(stash, joined)
    assert not joined.exists()


def test_a_new_pack_empties_the_stash_of_the_old_one(tmp_path: Path) -> None:
    stash = tmp_path / "stash"
    first = tmp_path / "first"
    carry.split(_archive(tmp_path, 4_000, seed=1), first, 1_500)
    carry.stash(first, stash)
    second = tmp_path / "second"
    (tmp_path / "new").mkdir()
    new_archive = _archive(tmp_path / "new", 4_000, seed=2)
    manifest = carry.split(new_archive, second, 1_500)
    (second / "part-01").unlink()
    (second / "part-02").unlink()
    assert carry.stash(second, stash) == ["part-00"]
    assert carry.missing_parts(stash) == ["part-01", "part-02"]
    assert json.loads((stash / carry.MANIFEST).read_text()) == manifest


def test_a_manifest_that_does_not_add_up_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "carry"
    carry.split(_archive(tmp_path, 3_000), out, 1_000)
    manifest = json.loads((out / carry.MANIFEST).read_text())
    manifest["parts"].pop()
    (out / carry.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(carry.CarryError, match="the parts hold 2000 bytes, the archive 3000"):
        carry.read_manifest(out)
    (out / carry.MANIFEST).unlink()
    with pytest.raises(carry.CarryError, match=r"no manifest\.json"):
        carry.stash(out, tmp_path / "stash")


def test_budget_leaves_room_for_the_tracked_files() -> None:
    limit = 64 * 1024 * 1024
    budget = carry.part_budget(limit, 3_000_000)
    assert budget == limit - 3_000_000 - carry.MARGIN
    with pytest.raises(carry.CarryError, match="leave no room"):
        carry.part_budget(limit, limit - carry.MARGIN)


def _wheel(directory: Path, name: str, version: str, files: dict[str, tuple[bytes, int]]) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, (data, mode) in files.items():
            info = zipfile.ZipInfo(member)
            info.external_attr = (0o100000 | mode) << 16
            z.writestr(info, data)
    return path


def test_wheels_unpack_into_a_site_that_archives_and_extracts_with_modes(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(
        wheels,
        "my_pkg",
        "1.0",
        {
            "my_pkg/__init__.py": (b"X = 1\n", 0o644),
            "my_pkg/bin/raylet": (b"#!/bin/sh\n", 0o755),
            "my_pkg-1.0.data/purelib/extra_mod.py": (b"Y = 2\n", 0o644),
        },
    )
    _wheel(wheels, "pandas", "3.0", {"pandas/__init__.py": (b"", 0o644), "pandas/tests/t.py": (b"", 0o644)})
    _wheel(wheels, "other", "2.0", {"other.py": (b"", 0o644)})
    site = tmp_path / "site"
    unpacked = carry.unpack_wheels(wheels, site, ["my-pkg==1.0", "pandas==3.0"])
    assert sorted(w.name for w in unpacked) == ["my_pkg-1.0-py3-none-any.whl", "pandas-3.0-py3-none-any.whl"]
    assert (site / "extra_mod.py").read_text() == "Y = 2\n" and not list(site.glob("*.data"))
    assert os.access(site / "my_pkg" / "bin" / "raylet", os.X_OK)
    assert not (site / "pandas" / "tests").exists() and not (site / "other.py").exists()
    archive = tmp_path / "site.tar.xz"
    carry.archive_site(site, archive, preset=1)
    with tarfile.open(archive) as tar:
        assert "./my_pkg/bin/raylet" in tar.getnames()
    again = tmp_path / "again"
    carry.extract_site(archive, again)
    assert (again / "my_pkg" / "__init__.py").read_text() == "X = 1\n"
    assert os.access(again / "my_pkg" / "bin" / "raylet", os.X_OK)
    with pytest.raises(carry.CarryError, match=r"0 wheels of absent==1\.0"):
        carry.unpack_wheels(wheels, site, ["absent==1.0"])


def test_closure_follows_extras_and_leaves_out_what_the_machine_has() -> None:
    """Ray's closure, from this venv's own metadata: the serve and data extras are followed."""
    names = {carry.canonical(name) for name, _ in carry.closure(["ray[serve,data]"])}
    assert {"ray", "fastapi", "uvicorn", "pyarrow", "pandas", "aiohttp", "pydantic"} <= names
    assert not names & {carry.canonical(n) for n in carry.MACHINE_HAS}
    plain = {carry.canonical(name) for name, _ in carry.closure(["ray"])}
    assert "fastapi" not in plain and "pyarrow" not in plain and "msgpack" in plain
    kept = {carry.canonical(name) for name, _ in carry.closure(["ray[data]"], exclude=())}
    assert "numpy" in kept
    with pytest.raises(carry.CarryError, match="not installed"):
        carry.closure(["no-such-distribution-here"])


def test_cli_split_stash_join(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = _archive(tmp_path, 2_500)
    out = tmp_path / "carry"
    assert carry.main(["split", str(archive), str(out), "--part-bytes", "1000"]) == 0
    stash = tmp_path / "stash"
    (out / "part-02").rename(tmp_path / "later")
    assert carry.main(["stash", str(out), str(stash)]) == 0
    assert carry.main(["missing", str(stash)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "part-02"
    assert carry.main(["join", str(stash), str(tmp_path / "joined")]) == 1
    assert "part-02" in capsys.readouterr().err
    (tmp_path / "later").rename(out / "part-02")
    assert carry.main(["stash", str(out), str(stash)]) == 0
    assert carry.main(["join", str(stash), str(tmp_path / "joined")]) == 0
    assert (tmp_path / "joined").read_bytes() == archive.read_bytes()
