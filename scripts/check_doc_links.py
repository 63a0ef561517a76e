"""Check that every relative link of README.md and docs/*.md resolves in the tree, and that
no page cites this project's tracker.

A link ``[text](path#anchor)`` must name a file or folder that exists, relative to the page
it is on; an anchor into a Markdown page must name one of its headings (GitHub's slugs:
lower case, punctuation dropped, spaces as hyphens). Web links (``http:``, ``https:``,
``mailto:``) are not followed. Links inside code blocks and inline code are ignored.

The docs speak to users, who do not read the tracker: ``issue 42``, ``issues 41 and 42``,
``#42`` and record names after issues (``bench/issue22-ceiling.json``) fail, in prose and
code alike; a link to another project's tracker (``https://github.com/o/r/issues/42``) is
fine. Records are named by what they measure.

    python scripts/check_doc_links.py            # exit 1 and one line per broken link or tracker number

``PENDING`` lists pages that other work is writing; links to them are reported, not failed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PENDING: set[str] = set()
"""Pages another change creates (the GPU backend's docs/gpu.md): a link to one is noted, not failed."""

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_TRACKER = re.compile(
    r"\b(?:issues?|tickets?|bugs?|PRs?|pull requests?)\s*#?\d+"  # issue 42, issues 41, PR #7
    r"|(?<![\w&/#])#\d+\b"  # #42 (not &#42; nor a URL's fragment)
    r"|\bissue\d+",  # a record named after an issue: issue22-ceiling.json
    re.IGNORECASE,
)
_WEB_LINK = re.compile(r"https?://\S+")


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: ``Limits: what one request may cost`` -> ``limits-what-one-request-may-cost``."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(broken links, links to pending pages), each as ``page:line: target``."""
    broken, pending = [], []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        for number, line in _prose_lines(text):
            for target in _LINK.findall(_INLINE_CODE.sub("", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                where = f"{page.relative_to(root)}:{number}: {target}"
                path_part, _, anchor = target.partition("#")
                dest = (page.parent / path_part).resolve() if path_part else page
                try:
                    rel = dest.relative_to(root).as_posix()
                except ValueError:
                    broken.append(where + " (outside the repository)")
                    continue
                if rel in PENDING:
                    pending.append(where)
                    continue
                if not dest.exists():
                    broken.append(where + " (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(where + " (no such heading)")
    return broken, pending


def tracker_numbers(root: Path = ROOT) -> list[str]:
    """Citations of this project's tracker in README.md and docs/ (prose and code blocks;
    web addresses skipped), each as ``page:line: text``."""
    found = []
    for page in pages(root):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in _TRACKER.finditer(_WEB_LINK.sub("", line)):
                found.append(f"{page.relative_to(root)}:{number}: {m.group(0)}")
    return found


def main() -> int:
    broken, pending = broken_links()
    tracker = tracker_numbers()
    for line in pending:
        print(f"pending: {line}")
    for line in broken:
        print(f"broken: {line}")
    for line in tracker:
        print(f"tracker number: {line} (the docs speak to users: say what changed or what a record measures)")
    return 1 if broken or tracker else 0


if __name__ == "__main__":
    sys.exit(main())
