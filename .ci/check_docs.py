#!/usr/bin/env python3
"""Check that every relative link and every command in the docs resolves.

Reads README.md, ARCHITECTURE.md and docs/*.md and fails, naming the file and line, when:
- a relative link `[text](path)` or `[text](path#anchor)` names a file that does not exist,
  or an anchor that no heading of the target makes (GitHub's slug rules);
- a shell block (```sh) runs an `rdzv` subcommand that the binary does not know: each
  `rdzv A B ...` (or `target/release/rdzv`, `cargo run --release -- A ...`) is checked by
  running `rdzv A B --help` with the words before the first argument or option;
- a shell block runs a script of the repository (`benches/x.py`, `.ci/x.sh`, `tests/...`)
  that does not exist.

Usage: .ci/check_docs.py [RDZV_BINARY]   (default: target/debug/rdzv; without a binary the
command check is skipped, saying so, and only the links and scripts are checked)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"(?:^|\s)((?:benches|\.ci|tests|rdma|contrib|python)/[\w./-]+\.(?:py|sh)|rdma/softroce/run)\b")
WORD = re.compile(r"^[a-z][a-z0-9-]*$")
# Options of `rdzv` and `rdzv store` that may come before a subcommand.
GLOBAL_WITH_VALUE = {"--addr", "--token-file", "--log-format", "-o", "--connect-timeout"}
GLOBAL_FLAGS = {"--hex", "--json"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def check_links(path: Path, errors: list[str]) -> None:
    fence = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else (path.parent / file_part).resolve()
            where = f"{path.relative_to(ROOT)}:{number}"
            if not dest.exists():
                errors.append(f"{where}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                errors.append(f"{where}: link to {target}: no heading makes #{anchor}")


def shell_lines(path: Path):
    fence = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        if fence in ("sh", "bash", "console"):
            yield number, line


def subcommand(line: str) -> list[str] | None:
    """The words of an `rdzv` invocation up to its first argument, or None."""
    line = line.split("#", 1)[0].strip()
    match = re.search(r"(?:^|[\s;&|(])(?:\S*/)?rdzv\s+(.*)$", line)
    cargo = re.search(r"cargo run (?:--release )?(?:-p rdzv )?-- (.*)$", line)
    rest = cargo.group(1) if cargo else (match.group(1) if match else None)
    if rest is None:
        return None
    words: list[str] = []
    tokens = iter(rest.split())
    for word in tokens:
        if word in GLOBAL_WITH_VALUE:
            next(tokens, None)  # `rdzv store --addr X set ...`: the subcommand follows
            continue
        if word in GLOBAL_FLAGS:
            continue
        if word.startswith("-") or not WORD.match(word):
            break
        words.append(word)
    return words


def check_commands(path: Path, rdzv: Path | None, errors: list[str], seen: dict) -> None:
    for number, line in shell_lines(path):
        where = f"{path.relative_to(ROOT)}:{number}"
        for script in SCRIPT.findall(line):
            if not (ROOT / script).exists():
                errors.append(f"{where}: runs {script}: no such file")
        words = subcommand(line)
        if not words or rdzv is None:
            continue
        # `rdzv store serve ... KEY` style: try the longest prefix the binary knows.
        key = tuple(words)
        if key not in seen:
            ok = False
            for n in range(len(words), 0, -1):
                run = subprocess.run([str(rdzv), *words[:n], "--help"], capture_output=True)
                if run.returncode == 0:
                    ok = n == len(words) or not _takes_subcommand(rdzv, words[:n])
                    break
            seen[key] = ok
        if not seen[key]:
            errors.append(f"{where}: `rdzv {' '.join(words)}`: not a subcommand of {rdzv}")


def _takes_subcommand(rdzv: Path, words: list[str]) -> bool:
    """Whether `rdzv WORDS` wants a subcommand (its help lists 'Commands:')."""
    run = subprocess.run([str(rdzv), *words, "--help"], capture_output=True, text=True)
    return "\nCommands:" in run.stdout


def main() -> int:
    rdzv = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target" / "debug" / "rdzv"
    if not rdzv.exists():
        print(f"check_docs: no binary at {rdzv}; checking links and scripts only")
        rdzv = None
    errors: list[str] = []
    seen: dict = {}
    files = docs()
    for path in files:
        check_links(path, errors)
        check_commands(path, rdzv, errors, seen)
    for error in errors:
        print(error)
    print(f"check_docs: {len(files)} files, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
