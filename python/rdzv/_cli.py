"""The ``rdzv`` console script: runs the ``rdzv`` binary shipped inside the package.

maturin ships no binary beside a PyO3 extension, so the wheel carries the CLI as package
data (``rdzv/_bin/rdzv``, built by ``python/build.rs``) and this entry point replaces the
Python process with it, so that signals, exit codes and standard streams are the
binary's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def binary() -> Path:
    """The path of the bundled ``rdzv`` binary."""
    return Path(__file__).resolve().parent / "_bin" / "rdzv"


def main() -> None:
    """Replaces this process with ``rdzv`` and the same arguments."""
    path = binary()
    if not os.access(path, os.X_OK):
        sys.stderr.write(
            f"rdzv: the bundled binary {path} is missing or not executable; "
            "reinstall the rdzv package (pip install --force-reinstall rdzv)\n"
        )
        raise SystemExit(127)
    os.execv(str(path), [str(path), *sys.argv[1:]])


if __name__ == "__main__":
    main()
