"""Tiny random-weight checkpoints and a locally trained tokenizer, for tests and demos.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers`
on a built-in corpus, and checkpoints are built with Transformers + torch (CPU)
from small configs, then saved as safetensors. torch and transformers' modelling
code are test dependencies, imported only here.
"""

from jvllm.testing.checkpoints import ARCHITECTURES, make_checkpoint
from jvllm.testing.tokenizer import make_tokenizer

__all__ = ["ARCHITECTURES", "make_checkpoint", "make_tokenizer"]
