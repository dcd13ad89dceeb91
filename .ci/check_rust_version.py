#!/usr/bin/env python3
"""Checks that the workspace's `rust-version` is at least what every locked dependency
declares (its own `rust-version`), so that the manifest tells users the truth.

CI machines have one toolchain and cannot fetch another; this reads what the
dependencies say instead of building with the oldest compiler. Exits 1 naming the
dependencies that need more.
"""
import json
import subprocess
import sys


def version(text):
    """`1.88` and `1.88.0` compare equal."""
    parts = [int(part) for part in text.split(".")]
    return tuple((parts + [0, 0, 0])[:3])


def main():
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    members = set(meta["workspace_members"])
    ours = {
        p["name"]: p["rust_version"]
        for p in meta["packages"]
        if p["id"] in members and p.get("rust_version")
    }
    if not ours:
        print("no workspace member declares rust-version")
        return 1
    declared = min(version(v) for v in ours.values())
    needs = sorted(
        (
            (version(p["rust_version"]), p["name"], p["version"])
            for p in meta["packages"]
            if p["id"] not in members and p.get("rust_version")
        ),
        reverse=True,
    )
    too_new = [n for n in needs if n[0] > declared]
    shown = ".".join(map(str, declared))
    if too_new:
        print(f"rust-version {shown} is too old for the locked dependencies:")
        for need, name, ver in too_new:
            print(f"  {name} {ver} needs Rust {'.'.join(map(str, need))}")
        print("raise [workspace.package] rust-version in Cargo.toml")
        return 1
    top = needs[0] if needs else None
    print(
        f"rust-version {shown} covers every locked dependency"
        + (f" (the newest need: {top[1]} {top[2]}, Rust {'.'.join(map(str, top[0]))})" if top else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
