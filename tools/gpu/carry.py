"""Carry a large archive to the GPU machine in parts that each fit one call's carry limit.

What a lent GPU machine is given travels with the working tree, at most 64 MiB per
call, and ignored folders (and ``/tmp``) stay there between calls on a warm
machine. Ray and its dependencies are larger than one call, so ``tools/gpu/pack.sh``
packs them into one archive and cuts it here into parts, each small enough to
ride along with the tracked files; ``tools/gpu/run.sh`` stashes each part as it
arrives and joins them once all are there. The manifest (``manifest.json``)
names every part with its size and SHA-256, and the archive's own size and
SHA-256, so a part that is missing, cut short or corrupted is named, and the
joined archive is the packed one byte for byte.

Commands (the device side needs only the standard library)::

    python3 carry.py closure ROOT... [--exclude NAME...]     # name==version lines, from this env
    python3 carry.py site WHEEL_DIR SITE SPEC...             # unpack one wheel per spec into SITE
    python3 carry.py archive SITE ARCHIVE                    # SITE as a .tar.xz (modes kept)
    python3 carry.py budget --limit BYTES --repo BYTES       # largest part that fits one call
    python3 carry.py split ARCHIVE OUT_DIR --part-bytes N    # parts + manifest.json in OUT_DIR
    python3 carry.py stash CARRY_DIR STASH_DIR               # verify arrived parts, keep them
    python3 carry.py missing STASH_DIR                       # parts not there yet, one a line
    python3 carry.py join STASH_DIR ARCHIVE                  # every part there: rebuild, verify
    python3 carry.py extract ARCHIVE SITE                    # the joined archive, unpacked
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CHUNK = 1 << 20
CALL_LIMIT = 64 * 1024 * 1024
MARGIN = 2 * 1024 * 1024  # untracked files, the manifest, what the tree grows by between pack and carry

# Distributions the GPU machine has already (Python 3.12 with numpy 2, torch and its
# dependencies, cupy, grpcio, protobuf, pytest), or that .gpu-carry/client brings.
MACHINE_HAS = frozenset(
    {
        "numpy", "torch", "cupy-cuda12x", "cupy-cuda13x", "fastrlock", "cuda-pathfinder", "grpcio",
        "protobuf", "pytest", "pluggy", "iniconfig", "pygments", "filelock", "fsspec", "jinja2",
        "markupsafe", "networkx", "sympy", "mpmath", "setuptools", "typing-extensions",
        # .gpu-carry/client
        "tritonclient", "python-rapidjson", "ml-dtypes", "packaging", "urllib3",
    }
)  # fmt: skip


class CarryError(Exception):
    """A part is missing, the wrong size or corrupted, or the manifest does not describe the archive."""


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Typing_Extensions`` is ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def part_budget(limit: int, repo_bytes: int, margin: int = MARGIN) -> int:
    """The largest part that fits one call beside the tracked files.

    Args:
        limit: What one call may carry, the working tree included.
        repo_bytes: The tracked files' bytes.
        margin: Room kept for untracked files and the manifest.

    Raises:
        CarryError: The tracked files alone leave no room.
    """
    budget = limit - repo_bytes - margin
    if budget < CHUNK:
        raise CarryError(f"{repo_bytes} bytes of tracked files leave no room for a part under {limit} bytes")
    return budget


def split(archive: Path, out_dir: Path, part_bytes: int) -> dict[str, Any]:
    """Cut ``archive`` into ``part-NN`` files of at most ``part_bytes`` and write the manifest.

    Returns:
        The manifest: the archive's name, size and SHA-256, and each part's name, size and SHA-256.
    """
    if part_bytes <= 0:
        raise CarryError(f"part size must be positive, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*"):
        old.unlink()
    parts = []
    whole = hashlib.sha256()
    size = archive.stat().st_size
    count = max(1, -(-size // part_bytes))
    width = max(2, len(str(count - 1)))
    with open(archive, "rb") as source:
        for index in range(count):
            name = f"part-{index:0{width}d}"
            digest = hashlib.sha256()
            written = 0
            with open(out_dir / name, "wb") as part:
                while written < part_bytes:
                    block = source.read(min(CHUNK, part_bytes - written))
                    if not block:
                        break
                    part.write(block)
                    digest.update(block)
                    whole.update(block)
                    written += len(block)
            parts.append({"name": name, "bytes": written, "sha256": digest.hexdigest()})
    manifest = {
        "archive": archive.name,
        "bytes": size,
        "sha256": whole.hexdigest(),
        "part_bytes": part_bytes,
        "parts": parts,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest in ``directory``, checked to add up (parts cover the archive's bytes)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CarryError(f"no {MANIFEST} in {directory}: carry it with every part")
    manifest = json.loads(path.read_text())
    missing = [key for key in ("archive", "bytes", "sha256", "parts") if key not in manifest]
    if missing:
        raise CarryError(f"{path} lacks {missing}")
    total = sum(int(p["bytes"]) for p in manifest["parts"])
    if total != manifest["bytes"]:
        raise CarryError(f"{path}: the parts hold {total} bytes, the archive {manifest['bytes']}")
    return manifest


def check_part(path: Path, entry: dict[str, Any]) -> None:
    """Raise ``CarryError`` unless ``path`` is the manifest's part ``entry``, size and SHA-256."""
    if not path.is_file():
        raise CarryError(f"part {entry['name']} is missing ({path})")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CarryError(f"part {entry['name']} holds {size} bytes, the manifest says {entry['bytes']}")
    if sha256_of(path) != entry["sha256"]:
        raise CarryError(f"part {entry['name']} is corrupted (SHA-256 differs from the manifest)")


def stash(carry_dir: Path, stash_dir: Path) -> list[str]:
    """Copy the parts that arrived in ``carry_dir`` into ``stash_dir``, each checked first.

    The manifest is copied along. A manifest that differs from the stashed one (a
    new pack) empties the stash first.

    Returns:
        The names of the parts now in ``stash_dir``.
    """
    manifest = read_manifest(carry_dir)
    stash_dir.mkdir(parents=True, exist_ok=True)
    stashed_manifest = stash_dir / MANIFEST
    if stashed_manifest.is_file() and json.loads(stashed_manifest.read_text()) != manifest:
        for old in stash_dir.iterdir():
            old.unlink()
    shutil.copyfile(carry_dir / MANIFEST, stashed_manifest)
    for entry in manifest["parts"]:
        arrived = carry_dir / entry["name"]
        if arrived.exists():
            check_part(arrived, entry)
            kept = stash_dir / entry["name"]
            shutil.copyfile(arrived, kept.with_name(kept.name + ".partial"))
            os.replace(kept.with_name(kept.name + ".partial"), kept)
    return [entry["name"] for entry in manifest["parts"] if (stash_dir / entry["name"]).is_file()]


def missing_parts(stash_dir: Path) -> list[str]:
    """Parts of the stashed manifest not yet in ``stash_dir``."""
    manifest = read_manifest(stash_dir)
    return [entry["name"] for entry in manifest["parts"] if not (stash_dir / entry["name"]).is_file()]


def join(stash_dir: Path, archive: Path) -> dict[str, Any]:
    """Rebuild the archive from every part in ``stash_dir`` and check it against the manifest.

    Raises:
        CarryError: A part is missing (all missing ones named), the wrong size, or
            corrupted, or the joined bytes are not the packed archive.
    """
    manifest = read_manifest(stash_dir)
    missing = missing_parts(stash_dir)
    if missing:
        raise CarryError(f"parts {missing} have not arrived yet (of {len(manifest['parts'])})")
    whole = hashlib.sha256()
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with open(partial, "wb") as out:
        for entry in manifest["parts"]:
            path = stash_dir / entry["name"]
            check_part(path, entry)
            with open(path, "rb") as part:
                while block := part.read(CHUNK):
                    out.write(block)
                    whole.update(block)
    if whole.hexdigest() != manifest["sha256"] or partial.stat().st_size != manifest["bytes"]:
        partial.unlink()
        raise CarryError("the joined parts are not the packed archive (SHA-256 or size differs)")
    os.replace(partial, archive)
    return manifest


def closure(roots: Sequence[str], exclude: Iterable[str] = MACHINE_HAS) -> list[tuple[str, str]]:
    """``(name, version)`` of every distribution ``roots`` need, as installed in this environment.

    Args:
        roots: Requirements with extras, e.g. ``ray[serve,data]``.
        exclude: Distributions not to carry (the GPU machine has them); their own
            dependencies are not followed either.

    Raises:
        CarryError: A needed distribution is not installed here.
    """
    from importlib import metadata

    from packaging.requirements import Requirement

    skip = {canonical(name) for name in exclude}
    found: dict[str, tuple[str, str]] = {}
    pending = [Requirement(root) for root in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement = pending.pop()
        key = canonical(requirement.name)
        if key in skip:
            continue
        extras = frozenset(requirement.extras)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError as e:
            raise CarryError(f"{requirement.name} is needed but not installed in {sys.prefix}") from e
        found[key] = (dist.metadata["Name"], dist.version)
        for text in dist.requires or ():
            dependency = Requirement(text)
            if dependency.marker is not None:
                wanted = [{"extra": extra} for extra in extras] or [{"extra": ""}]
                if not any(dependency.marker.evaluate(env) for env in wanted):
                    continue
            pending.append(dependency)
    return sorted(found.values(), key=lambda item: canonical(item[0]))


def wheel_for(wheel_dir: Path, spec: str) -> Path:
    """The one wheel in ``wheel_dir`` for ``name==version`` (wheel names use ``_`` for ``-``).

    Raises:
        CarryError: None, or more than one, was downloaded.
    """
    name, _, version = spec.partition("==")
    found = [
        wheel
        for wheel in wheel_dir.glob("*.whl")
        if canonical(wheel.name.split("-")[0]) == canonical(name) and wheel.name.split("-")[1] == version
    ]
    if len(found) != 1:
        raise CarryError(f"{len(found)} wheels of {spec} in {wheel_dir}: {[w.name for w in found]}")
    return found[0]


SKIPPED_IN_SITE = ("pandas/tests/", "pyarrow/tests/", "numpy/tests/")


def unpack_wheels(wheel_dir: Path, site: Path, specs: Sequence[str]) -> list[Path]:
    """Unpack the wheel of each ``name==version`` into ``site`` as pip would lay out site-packages.

    File modes are kept (Ray's raylet and gcs_server must stay executable), a
    wheel's ``<name>.data/purelib`` and ``platlib`` are merged into ``site``, and
    the test suites of pandas and pyarrow are left out.

    Returns:
        The wheels unpacked.
    """
    wheels = [wheel_for(wheel_dir, spec) for spec in specs]
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if any(skip in info.filename for skip in SKIPPED_IN_SITE):
                    continue
                z.extract(info, site)
                mode = info.external_attr >> 16
                if mode & 0o777 and not info.is_dir():
                    (site / info.filename).chmod(mode & 0o777)
    for data in site.glob("*.data"):
        for kind in ("purelib", "platlib"):
            if (data / kind).is_dir():
                shutil.copytree(data / kind, site, dirs_exist_ok=True)
        shutil.rmtree(data)
    return wheels


def archive_site(site: Path, archive: Path, preset: int = 1) -> None:
    """``site`` as ``archive`` (tar, lzma), members relative to ``site``, modes kept."""
    with tarfile.open(archive, "w:xz", preset=preset) as tar:
        tar.add(site, arcname=".")


def extract_site(archive: Path, site: Path) -> None:
    """Unpack a joined archive into ``site`` (what ``archive_site`` packed)."""
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        tar.extractall(site, filter="tar")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="carry.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("closure")
    p.add_argument("roots", nargs="+")
    p.add_argument("--exclude", nargs="*", default=None, help="default: what the GPU machine has")
    p = sub.add_parser("site")
    p.add_argument("wheel_dir", type=Path)
    p.add_argument("site", type=Path)
    p.add_argument("specs", nargs="+")
    p = sub.add_parser("archive")
    p.add_argument("site", type=Path)
    p.add_argument("archive", type=Path)
    p.add_argument("--preset", type=int, default=1, help="lzma preset (1: fast; 9 saves a few percent)")
    p = sub.add_parser("extract")
    p.add_argument("archive", type=Path)
    p.add_argument("site", type=Path)
    p = sub.add_parser("missing")
    p.add_argument("stash_dir", type=Path)
    p = sub.add_parser("budget")
    p.add_argument("--limit", type=int, default=CALL_LIMIT)
    p.add_argument("--repo", type=int, required=True)
    p = sub.add_parser("split")
    p.add_argument("archive", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--part-bytes", type=int, required=True)
    p = sub.add_parser("stash")
    p.add_argument("carry_dir", type=Path)
    p.add_argument("stash_dir", type=Path)
    p = sub.add_parser("join")
    p.add_argument("stash_dir", type=Path)
    p.add_argument("archive", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "closure":
            exclude = MACHINE_HAS if args.exclude is None else args.exclude
            for name, version in closure(args.roots, exclude):
                print(f"{name}=={version}")
        elif args.command == "site":
            wheels = unpack_wheels(args.wheel_dir, args.site, args.specs)
            print(f"unpacked {len(wheels)} wheels into {args.site}")
        elif args.command == "archive":
            archive_site(args.site, args.archive, args.preset)
            print(f"{args.archive}: {args.archive.stat().st_size} bytes")
        elif args.command == "extract":
            extract_site(args.archive, args.site)
        elif args.command == "missing":
            for name in missing_parts(args.stash_dir) if (args.stash_dir / MANIFEST).is_file() else ["all"]:
                print(name)
        elif args.command == "budget":
            print(part_budget(args.limit, args.repo))
        elif args.command == "split":
            manifest = split(args.archive, args.out_dir, args.part_bytes)
            for entry in manifest["parts"]:
                print(f"{entry['name']}  {entry['bytes']} bytes")
        elif args.command == "stash":
            have = stash(args.carry_dir, args.stash_dir)
            missing = missing_parts(args.stash_dir)
            print(f"stashed: {have}; still to come: {missing or 'none'}")
        else:
            manifest = join(args.stash_dir, args.archive)
            print(f"joined {len(manifest['parts'])} parts: {manifest['bytes']} bytes, SHA-256 matches")
    except CarryError as e:
        print(f"carry: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
