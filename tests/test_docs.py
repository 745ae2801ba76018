"""Citations of the docs resolve: every `docs/<name>.md#<anchor>` in code and docs names a file
and a heading that exist, code no longer cites the old contract files, and relative links in
README.md and docs/*.md point at files that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("engine", "weight_sync", "rollout", "trainers_adapters", "fleet", "bench",
             "examples", "tests")
CODE_SUFFIXES = (".py", ".cpp", ".h")
CITATION = re.compile(r"docs/([A-Za-z0-9_.-]+?\.md)(?:#([A-Za-z0-9_-]+))?")
# The old contract files, cited bare (not as docs/api.md): spelled in two parts so that this
# file does not cite them itself.
OLD_CONTRACT = re.compile(r"(?<![\w/])(?:" + "API" + r"|" + "DESIGN" + r")\.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def code_files() -> list[Path]:
    files = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in CODE_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return files


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (outside code fences), GitHub's -1, -2 suffixes
    for repeated ones included."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1))


def where(path: Path, number: int) -> str:
    return f"{path.relative_to(ROOT)}:{number}"


def check_target(target: Path, anchor: str | None, cache: dict[Path, set[str]]) -> str | None:
    """Why a citation of target#anchor is broken, or None."""
    if not target.is_file():
        return "no such file"
    if anchor:
        if target not in cache:
            cache[target] = anchors(target)
        if anchor not in cache[target]:
            return f"no heading with anchor #{anchor}"
    return None


def test_citations_of_docs_resolve() -> None:
    broken, cache = [], {}
    for path in [*code_files(), *doc_files()]:
        for number, line in lines(path):
            for cited in dict.fromkeys(m.group(0) for m in CITATION.finditer(line)):
                name, anchor = CITATION.fullmatch(cited).groups()
                why = check_target(ROOT / "docs" / name, anchor, cache)
                if why:
                    broken.append(f"{where(path, number)}: {cited}: {why}")
    assert not broken, "citations of missing docs or headings:\n" + "\n".join(broken)


def test_code_cites_docs_not_the_old_contract_files() -> None:
    stale = [f"{where(path, number)}: {line.strip()}"
             for path in code_files() if path != Path(__file__).resolve()
             for number, line in lines(path) if OLD_CONTRACT.search(line)]
    assert not stale, ("cite docs/api.md or docs/design.md (with a section) instead:\n"
                       + "\n".join(stale))


def test_relative_links_in_docs_resolve() -> None:
    broken, cache = [], {}
    for path in doc_files():
        in_fence = False
        for number, line in lines(path):
            if FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for match in LINK.finditer(line):
                target = match.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = (path.parent / file_part).resolve() if file_part else path
                if file_part and resolved.suffix != ".md":
                    why = None if resolved.exists() else "no such file"
                else:
                    why = check_target(resolved, anchor or None, cache)
                if why:
                    broken.append(f"{where(path, number)}: ({target}): {why}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_follows_github() -> None:
    assert slug("The C++ kernels") == "the-c-kernels"
    assert slug("dtype: bf16 or fp32") == "dtype-bf16-or-fp32"
    assert slug("`generate` and `async_generate`") == "generate-and-async_generate"
    assert slug("Weight updates on every server or none") == (
        "weight-updates-on-every-server-or-none")
