"""The demo model's training text: Debian's `fortunes` packages, split and formatted.

Owns reading the fortune cookie files (BSD licence, `apt-get install fortunes
fortunes-min`), the fixed held-out split, the chat-formatted examples the demo is
trained on and the word list that tests check its answers against. Plain Python: no
jax, no tokenizer. The corpus is read from the installed packages, never shipped.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

FORTUNE_DIR = Path("/usr/share/games/fortunes")
INSTALL_COMMAND = "apt-get install -y fortunes fortunes-min"
# The two packages' files, less `ascii-art` (pictures drawn in characters) and
# `translate-me` (text to translate): named, so other installed cookie packages never
# change the corpus.
FILES = (
    "art computers cookie debian definitions disclaimer drugs education ethnic food fortunes "
    "goedel humorists kids knghtbrd law linux linuxcookie literature love magic medicine "
    "men-women miscellaneous news paradoxum people perl pets platitudes politics pratchett "
    "riddles science songs-poems sports startrek tao wisdom work zippy"
).split()
HELD_OUT_PERCENT = 2
# What a newcomer types first; each cookie is taught as an answer to one of these.
PROMPTS = (
    "Hello! Who are you?",
    "Tell me something.",
    "Tell me a fortune.",
    "Say something wise.",
    "Tell me a joke.",
    "Give me a quote.",
    "What do you know?",
    "Say something funny.",
    "Share a thought with me.",
    "What is on your mind?",
    "Hi!",
    "Tell me a story.",
)
_QA = re.compile(r"^Q:\s*(?P<q>.+?)\s*\n\s*A:\s*(?P<a>.+)$", re.DOTALL)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


class Example(NamedTuple):
    """One training example: a user turn and the assistant's answer (a whole cookie)."""

    prompt: str
    answer: str


def fortune_files(directory: Path = FORTUNE_DIR) -> list[Path]:
    """The corpus files, in FILES order so every run reads them alike."""
    files = [directory / name for name in FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"fortune files {missing} are missing from {directory}: install them with "
            f"`{INSTALL_COMMAND}`"
        )
    return files


def _clean(cookie: str) -> str:
    lines = [line.replace("\t", "    ").rstrip() for line in cookie.strip("\n").split("\n")]
    return "\n".join(lines).strip()


def read_cookies(files: Iterable[Path]) -> list[str]:
    """Every distinct cookie, in file order; cookies are separated by lines of `%`."""
    seen: set[str] = set()
    cookies = []
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for raw in re.split(r"^%\s*$", text, flags=re.MULTILINE):
            cookie = _clean(raw)
            if cookie and cookie not in seen:
                seen.add(cookie)
                cookies.append(cookie)
    return cookies


def is_held_out(cookie: str) -> bool:
    """A fixed ~2% of cookies, chosen by hash so the split never depends on order."""
    digest = hashlib.sha256(cookie.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELD_OUT_PERCENT


def to_example(cookie: str, index: int) -> Example:
    """A Q/A cookie answers its own question; any other answers one of PROMPTS."""
    qa = _QA.match(cookie)
    if qa:
        return Example(qa["q"], qa["a"])
    return Example(PROMPTS[index % len(PROMPTS)], cookie)


def examples(cookies: Iterable[str]) -> Iterator[Example]:
    for i, cookie in enumerate(cookies):
        yield to_example(cookie, i)


def split(cookies: list[str]) -> tuple[list[str], list[str]]:
    """(train, held_out) cookies."""
    held = [c for c in cookies if is_held_out(c)]
    return [c for c in cookies if not is_held_out(c)], held


def words(texts: Iterable[str]) -> set[str]:
    """Lower-case words (letters and inner apostrophes) that occur in texts."""
    found: set[str] = set()
    for text in texts:
        found.update(_WORD.findall(text.lower()))
    return found
