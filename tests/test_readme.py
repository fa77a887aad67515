"""The README as a map: short, its test command the one CI runs, and every relative link
in it, in docs/ and in bench/RESULTS.md pointing at a file (and heading) that exists;
every results JSON that RESULTS.md names is in bench/results/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "RESULTS.md"
PAGES = [README, RESULTS, *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.MULTILINE)
# A short commit id: 7-40 hex digits with at least one letter and one digit.
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
JSON_NAME = re.compile(r"(?<![\w/.{},-])([a-z0-9_{},.]+\.json)\b")
BRACES = re.compile(r"\{([^{}]*)\}")


def without_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked out (a `#` there is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """The fragment ids GitHub gives the page's headings."""
    seen: dict[str, int] = {}
    found = set()
    for title in HEADING.findall(without_code_blocks(page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def expand(name: str) -> list[str]:
    """Shell brace expansion of one name: `a_{x,y}_{1..3}.json` -> six names."""
    match = BRACES.search(name)
    if match is None:
        return [name]
    body = match.group(1)
    if ".." in body:
        low, high = body.split("..")
        choices = [str(i) for i in range(int(low), int(high) + 1)]
    else:
        choices = body.split(",")
    head, tail = name[: match.start()], name[match.end() :]
    return [full for choice in choices for full in expand(head + choice + tail)]


def test_readme_is_a_short_map():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; topic text goes to docs/"
    ids = COMMIT_ID.findall(text)
    assert not ids, f"commit ids belong in git, not in the README: {ids}"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.DOTALL)
    assert ci in blocks, f"the README's test command must be .ci/run's: {ci!r}"


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(without_code_blocks(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_results_name_only_files_that_exist():
    names = {n for found in JSON_NAME.findall(RESULTS.read_text()) for n in expand(found)}
    assert len(names) > 50  # the page names its sources
    missing = sorted(n for n in names if not (ROOT / "bench" / "results" / n).exists())
    assert not missing, f"RESULTS.md names JSON files bench/results/ lacks: {missing}"
