"""Make build/typecheck/stalwart/<folder>, links to the top-level folders, for mypy.

The editable install maps each top-level folder to a subpackage of ``stalwart`` with an import
hook, which mypy cannot follow; this tree of links (named in ``[tool.mypy] mypy_path``) lets it
find ``stalwart.*`` as laid out in ``[tool.setuptools.package-dir]``. Links to folders, so new
modules need no rerun. Safe to run again.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREE = Path("build") / "typecheck"


def make_tree(repo: Path = REPO) -> Path:
    """Create (or repair) the tree under ``repo``; returns its ``stalwart`` folder."""
    with open(repo / "pyproject.toml", "rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    top = repo / TREE / "stalwart"
    top.mkdir(parents=True, exist_ok=True)
    for package, folder in package_dir.items():
        link = top / package.removeprefix("stalwart.")
        target = os.path.relpath(repo / folder, top)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return top


if __name__ == "__main__":
    print(make_tree(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO))
