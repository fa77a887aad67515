"""`--chat-template`: a file path or the Jinja template itself, as vLLM takes it.

Owns telling the two apart and reading the file; applying the template is
`serving_chat.render_chat`'s.
"""

from __future__ import annotations

from pathlib import Path

# A value holding any of these is a template, not a path (vLLM's rule of thumb).
_TEMPLATE_CHARS = set("{}\n")


def load_chat_template(value: str | None) -> str | None:
    """The template text; None keeps the tokenizer's. A missing file raises."""
    if value is None:
        return None
    if _TEMPLATE_CHARS & set(value):
        return value
    path = Path(value)
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return path.read_text()
