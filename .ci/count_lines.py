#!/usr/bin/env python3
"""Counts the non-test lines of Rust under the paths given (files or folders).

A line is a test's when it lies in an item marked `#[cfg(test)]` (a `mod unit { ... }`
block, or the file that a `#[cfg(test)] mod tests;` names), or in a crate's `tests/`,
`benches/` or `fuzz/` folder. For each path it prints the lines, and the code lines
among them (neither blank nor only a `//` comment).

    python3 .ci/count_lines.py core/src/rendezvous/elastic core/src/channel rdma bench
"""

import pathlib
import re
import sys

TEST_DIRS = {"tests", "benches", "fuzz", "target"}
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")


def test_files(path: pathlib.Path, lines: list[str]) -> set[pathlib.Path]:
    """The files that `#[cfg(test)] mod name;` declarations in `path` name."""
    names = set()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == "#[cfg(test)]":
            decl = MOD_DECL.match(lines[i + 1])
            if decl:
                names.add(decl.group(1))
    here = path.parent if path.name in ("mod.rs", "lib.rs", "main.rs") else path.with_suffix("")
    found = set()
    for name in names:
        found.add(here / f"{name}.rs")
        found.add(here / name / "mod.rs")
    return found


def non_test(lines: list[str]) -> list[str]:
    """The lines outside `#[cfg(test)]` items."""
    kept, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "#[cfg(test)]":
            kept.append(lines[i])
            i += 1
            continue
        # Skip the item: a declaration ending in `;`, or a block up to its closing brace.
        depth, opened = 0, False
        i += 1
        while i < len(lines):
            text = lines[i].split("//")[0]
            depth += text.count("{") - text.count("}")
            opened = opened or "{" in text
            i += 1
            if (opened and depth <= 0) or (not opened and text.rstrip().endswith(";")):
                break
    return kept


def count(root: pathlib.Path) -> tuple[int, int]:
    files = [root] if root.is_file() else sorted(root.rglob("*.rs"))
    files = [f for f in files if not TEST_DIRS & set(f.relative_to(root).parts[:-1])]
    excluded: set[pathlib.Path] = set()
    texts = {}
    for f in files:
        texts[f] = f.read_text(encoding="utf-8").splitlines()
        excluded |= test_files(f, texts[f])
    total = code = 0
    for f in files:
        if f in excluded:
            continue
        kept = non_test(texts[f])
        total += len(kept)
        code += sum(1 for l in kept if l.strip() and not l.strip().startswith("//"))
    return total, code


def main(paths: list[str]) -> None:
    grand = [0, 0]
    for p in paths:
        total, code = count(pathlib.Path(p))
        grand[0] += total
        grand[1] += code
        print(f"{p:40} {total:7} lines {code:7} code")
    print(f"{'total':40} {grand[0]:7} lines {grand[1]:7} code")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
