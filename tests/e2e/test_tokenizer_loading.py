"""`load_tokenizer` against Transformers' AutoTokenizer: the same tokenizer, with or
without the direct load of the generic fast tokenizer (which skips importing torch)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jvllm.demo import DEMO_MODEL_DIR
from jvllm.tokenizer_loading import _loads_generic_tokenizer, load_tokenizer

TEXTS = ["the quick brown fox", "<s> hello </s> world", "", "  spaced   out  ", "naïve café 🙂"]


def _same_tokenizer(path: Path) -> None:
    ours, theirs = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    if theirs.chat_template is not None:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        kw = dict(tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(chat, **kw) == theirs.apply_chat_template(chat, **kw)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_checkpoint_tokenizers_equal_autotokenizer(checkpoints: dict[str, Path], arch: str) -> None:
    # Mistral (a backend of its own may apply) and qwen2 (Qwen2Tokenizer whatever the
    # file says) keep AutoTokenizer; llama and qwen3 load the generic class directly.
    assert _loads_generic_tokenizer(checkpoints[arch]) == (arch in ("llama", "qwen3"))
    _same_tokenizer(checkpoints[arch])


def test_demo_tokenizer_equals_autotokenizer() -> None:
    assert _loads_generic_tokenizer(Path(DEMO_MODEL_DIR))
    _same_tokenizer(Path(DEMO_MODEL_DIR))


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "LlamaTokenizer"},  # a class of its own: AutoTokenizer decides
        {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},  # custom code
    ],
)
def test_other_tokenizer_configs_go_through_autotokenizer(
    checkpoints: dict[str, Path], tmp_path: Path, change: dict
) -> None:
    path = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | change))
    assert not _loads_generic_tokenizer(path)


def test_a_config_that_is_no_object_goes_through_autotokenizer(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], path)
    (path / "config.json").write_text("[1, 2]")
    assert not _loads_generic_tokenizer(path)


def test_missing_files_go_through_autotokenizer(tmp_path: Path) -> None:
    assert not _loads_generic_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_direct_load_does_not_import_torch(checkpoints: dict[str, Path]) -> None:
    code = (
        "import sys; from jvllm.tokenizer_loading import load_tokenizer; "
        f"load_tokenizer({str(checkpoints['qwen3'])!r}); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


_CONCURRENT = """
import threading
from jvllm.demo import DEMO_MODEL_DIR
from jvllm.draft_models import check_draft_tokenizer
from jvllm.tokenizer_loading import load_tokenizer

demo, errors = str(DEMO_MODEL_DIR), []

def run(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        errors.append(repr(e))

threads = [
    threading.Thread(target=run, args=(load_tokenizer, demo)),
    threading.Thread(target=run, args=(check_draft_tokenizer, demo, demo)),
]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
"""


def test_a_draft_tokenizer_checked_while_the_engine_loads_its_own():
    """The engine loads its tokenizer on a thread while the main thread loads a draft model,
    whose tokenizer is checked too: Transformers' first imports from two threads at once
    failed ("cannot import name ...") before tokenizers loaded one at a time."""
    subprocess.run([sys.executable, "-c", _CONCURRENT], check=True, timeout=300)
