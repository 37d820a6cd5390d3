"""The docs hold together: every relative link in README.md, docs/ and benchmarks/README.md resolves (a file, or a
heading of the page it names), the README stays a front door (at most 250 lines), and no code or doc cites an
issue number or the design document instead of stating its rule. In-process file reads only (unit tier)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT  # noqa: E402
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Where a citation may not appear: the code, its configs and scripts, the tests and the docs.
CITATION_ROOTS = ["mgrpo", "kernels", "launchers", "benchmarks", "docs", "tests", "configs", "slurm", "README.md"]
CITATION = re.compile(r"issue [0-9]|issues? #?[0-9]|DESIGN\.md", re.I)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".txt", ".json", ".jsonl", ".csv", ".cfg",
                 ".j2", ""}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def broken_links(page: Path) -> list[str]:
    """`page: target` for each relative link of the page that names no file, or no heading of the page it names.
    Links inside code (fenced blocks, backquotes) are not links."""
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
            out.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return out


def citations() -> list[str]:
    found = []
    for name in CITATION_ROOTS:
        top = ROOT / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix not in TEXT_SUFFIXES:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for n, line in enumerate(text.splitlines(), start=1):
                if CITATION.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    return found


def test_every_relative_link_resolves():
    assert len(PAGES) >= 10, [str(p) for p in PAGES]
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_nothing_cites_an_issue_or_the_design_document():
    found = citations()
    assert not found, "state the rule itself instead of citing an issue or DESIGN:\n" + "\n".join(found)


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nowhere)\n"
                    "[web](https://example.com) `[code](not-a-link.md)`\n```\n[block](also-not.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["page.md: missing.md (no such file)",
                                      "page.md: there.md#nowhere (no such heading)"]
    finally:
        ROOT = saved
    word, design = "issue", "DESIGN" + ".md"  # spelled apart, so this file cites nothing itself
    for cited in (f"as {word} 35 says", f"see {word.title()} 9", f"{word}s #12", f"{design} section 6"):
        assert CITATION.search(cited), cited
    assert not CITATION.search("the driver imports no torch (~136 MiB)")
    assert anchor("Will it fit? `mgrpo-plan`") == "will-it-fit-mgrpo-plan"
