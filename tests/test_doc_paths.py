"""What README.md and docs/ point a reader to exists in this repository: every repository
path in backticks, every relative link, and every console script in the README's list.

A fresh clone is all a reader has: a path outside it (``../shared/...``) or a renamed
module sends them nowhere.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from .support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Directories the commands create at run time, not files of the repository.
RUNTIME_DIRS = (".retina-cluster/", ".venv/", ".venv-peers/")
SKIPPED_DIRS = {".git", ".venv", ".venv-peers", "__pycache__", ".pytest_cache", ".ruff_cache",
                "build", "node_modules", ".retina-cluster"}
BACKTICKED = re.compile(r"`([^`\n]+)`")
# Words and slashes only: no spaces, URLs (":"), placeholders ("<host>") or etcd keys.
PATH_LIKE = re.compile(r"[\w.*-]+(/[\w.*-]+)*/?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# What a fresh clone does not have: the notes outside the repository the project began from.
# Their facts are written into docs/ (docs/architecture.md is the map); nothing cites them.
OUTSIDE = re.compile(r"ARCHITECTURE\.md|\.\./shared\b|\bseeds/|\b(seed|specification) 00\d\b")
CITING = (".py", ".pyi", ".md", ".proto", ".toml", ".cfg", ".ini", ".txt", ".sh", ".yml", ".yaml",
          ".json", "Makefile", "Dockerfile")


def repository_paths() -> list[str]:
    """Every file and directory, relative to the root, directories ending in "/"."""
    found: list[str] = []
    stack = [ROOT]
    while stack:
        for entry in stack.pop().iterdir():
            if entry.name in SKIPPED_DIRS:
                continue
            relative = entry.relative_to(ROOT).as_posix()
            if entry.is_dir():
                found.append(relative + "/")
                stack.append(entry)
            else:
                found.append(relative)
    return found


def cited_paths(text: str) -> list[str]:
    """Backticked spans that name a file (a suffix like .py) or a directory (a trailing
    "/") with at least one "/": ``minio/mc`` or ``spark_jobs.storage_gc`` are not paths."""
    cited = []
    for span in BACKTICKED.findall(text):
        if ("/" not in span or span.startswith(("/", "...")) or span.startswith(RUNTIME_DIRS)
                or not PATH_LIKE.fullmatch(span)):
            continue
        if span.endswith("/") or re.search(r"\.\w+$", span.rsplit("/", 1)[-1]):
            cited.append(span)
    return cited


def exists(span: str, paths: list[str]) -> bool:
    """In the repository, from its root or under any directory: a list under "Code:
    `cdc_client/`" names `sources/postgres.py`. Globs (`*_pb2*.py`) must match."""
    return any(fnmatch.fnmatchcase(path, span) or fnmatch.fnmatchcase(path, "*/" + span)
               for path in paths)


def test_every_backticked_repository_path_exists() -> None:
    paths = repository_paths()
    missing = [f"{doc.relative_to(ROOT)}: `{span}`" for doc in DOCS
               for span in cited_paths(doc.read_text()) if not exists(span, paths)]
    assert missing == []


def test_every_relative_link_exists() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: ({target})")
    assert broken == []


def test_the_readme_lists_every_console_command() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("Console commands"):].split("Every process", 1)[0]
    assert sorted(set(scripts) - set(BACKTICKED.findall(listed))) == []


def test_nothing_cites_a_file_outside_the_repository() -> None:
    """Product code, docs, tests, benchmarks and build files; this file shows the patterns."""
    this = Path(__file__).resolve()
    cited = []
    for relative in repository_paths():
        path = ROOT / relative
        if relative.endswith("/") or not relative.endswith(CITING) or path.resolve() == this:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                cited.append(f"{relative}:{number}: {line.strip()}")
    assert cited == []


def test_the_check_catches_a_path_outside_the_repository() -> None:
    # The checks above pass on the current docs; this one shows they can fail.
    paths = repository_paths()
    text = "see `../shared/ARCHITECTURE.md`, `retina/gc_job.py`, `retina_server/gc/gc_job.py`"
    assert [s for s in cited_paths(text) if not exists(s, paths)] == \
        ["../shared/ARCHITECTURE.md", "retina/gc_job.py"]
    citing = ["see ARCHITECTURE.md", "(seed 003: Pinot)", "specification 001, C01.1",
              "the seeds/ notes", "../shared"]
    assert [s for s in citing if OUTSIDE.search(s)] == citing
    own = ["docs/architecture.md", "specification C01.1", "seeds 1130 and 1131", "--seed 223"]
    assert [s for s in own if OUTSIDE.search(s)] == []
