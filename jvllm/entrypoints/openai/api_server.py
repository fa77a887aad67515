"""`python -m jvllm.entrypoints.openai.api_server --model DIR [flags]`, an alias of
`jvllm serve`, as vLLM's module of the same path is of `vllm serve`.

Owns nothing but the alias: the flags and their meaning are `jvllm.cli`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jvllm.cli import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
