"""Images in prompts: the checkpoint's processor, the image features of a request, and
which of them a step's rows cover.

Owns turning vLLM's `{"prompt": ..., "multi_modal_data": {"image": ...}}` into token ids
with each image's placeholder tokens expanded as the checkpoint's own `AutoProcessor`
expands them (Qwen2.5-VL: `engine/qwen_vl_processor.py`), and one `MultiModalFeature`
per image (its placeholder span, its pixels, a hash of them, Qwen2.5-VL's token grid);
`limit_mm_per_prompt`; decoding `data:` image URLs (`load_image_url`); the extra keys a
prefix-cache block covering image tokens is hashed and verified with (`block_mm_keys`),
so the same text with another image shares no block past the first image; and
`with_mm_features`, the images a step's rows cover (for M-RoPE, every image before each
row's end). Not owned: the encoder and the merge into the embeddings (the runner's).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlparse

import numpy as np

from jvllm.engine.qwen_vl_processor import QwenVLProcessor, is_qwen_vl
from jvllm.engine.request import Request
from jvllm.engine.step_io import MultiModalFeature, SchedulerOutput
from jvllm.engine.validation import InvalidRequestError


def _image(value: Any, index: int, allowed_domains: Sequence[str] = ()) -> Any:
    """A PIL image (bytes are decoded, an image URL loaded: `load_image_url`), or
    InvalidRequestError naming the bad one."""
    from PIL import Image

    if isinstance(value, str):
        return load_image_url(value, allowed_domains)
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, bytes | bytearray):
        try:
            return Image.open(io.BytesIO(value)).convert("RGB")
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad data
            raise InvalidRequestError(
                f"image {index} cannot be decoded ({type(e).__name__}: {e})", "image"
            ) from None
    raise InvalidRequestError(
        f"image {index} must be a PIL image, encoded image bytes or an image URL, got "
        f"{type(value).__name__}",
        "image",
    )


def load_image_url(url: str, allowed_domains: Sequence[str] | None = None) -> Any:
    """The image of an `image_url`: a `data:image/...;base64,` URL decoded; an http(s)
    URL only from `allowed_domains` (vLLM's --allowed-media-domains), else refused."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise InvalidRequestError(
                f"image_url data URL must be base64 ('data:image/png;base64,...'), got "
                f"{header[:40]!r}",
                "image_url",
            )
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            msg = "image_url data URL holds invalid base64"
            raise InvalidRequestError(msg, "image_url") from None
        return _image(raw, 0)
    domain = urlparse(url).hostname or ""
    if url.startswith(("http://", "https://")) and domain in (allowed_domains or ()):
        from urllib.request import urlopen

        try:
            with urlopen(url, timeout=10) as response:  # noqa: S310 - an allowed domain
                return _image(response.read(), 0)
        except OSError as e:
            msg = f"image_url {url!r} cannot be fetched: {e}"
            raise InvalidRequestError(msg, "image_url") from None
    raise InvalidRequestError(
        f"image_url {url[:80]!r} is not allowed: give a data: URL, or start the server with "
        f"--allowed-media-domains listing {domain or 'its domain'!r}",
        "image_url",
    )


def _image_hash(pixels: np.ndarray) -> str:
    digest = hashlib.sha256(str(pixels.shape).encode())
    digest.update(np.ascontiguousarray(pixels, np.float32).tobytes())
    return digest.hexdigest()


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token` in `ids`."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _split_runs(runs: list[tuple[int, int]], num_images: int) -> list[tuple[int, int]]:
    """Runs of placeholders cut into one span per image: adjacent images make one run.
    Every image has the same placeholder count (the processor resizes each to one size)."""
    total = sum(length for _, length in runs)
    if num_images == 0 or total % num_images:
        return runs
    per = total // num_images
    if any(length % per for _, length in runs):
        return runs
    return [(o + k * per, per) for o, length in runs for k in range(length // per)]


class MultiModalProcessor:
    """A vision-language checkpoint's `AutoProcessor`, with `limit_mm_per_prompt`."""

    def __init__(
        self,
        model_dir: str,
        limit_mm_per_prompt: dict[str, int] | None = None,
        allowed_media_domains: Sequence[str] = (),
    ) -> None:
        from transformers import AutoProcessor

        self.allowed_media_domains = tuple(allowed_media_domains)
        limits = dict(limit_mm_per_prompt or {})
        unknown = set(limits) - {"image"}
        if unknown or any(not isinstance(v, int) or v < 0 for v in limits.values()):
            raise ValueError(
                f"limit_mm_per_prompt must map 'image' to a count >= 0, got {limits!r}"
            )
        self.max_images = limits.get("image")
        # Qwen2.5-VL's own processor needs torchvision (its video part): its parts instead.
        qwen = is_qwen_vl(model_dir)
        self.processor = (
            QwenVLProcessor(model_dir) if qwen else AutoProcessor.from_pretrained(model_dir)
        )
        tok = self.processor.tokenizer
        self.image_token_id = int(tok.convert_tokens_to_ids(self.processor.image_token))

    def process(
        self, prompt: dict[str, Any]
    ) -> tuple[str, list[int], tuple[MultiModalFeature, ...]]:
        """The prompt's text, its ids with the image placeholders expanded, its images."""
        data = prompt["multi_modal_data"] or {}
        unknown = set(data) - {"image"}
        if unknown:
            raise InvalidRequestError(
                f"multi_modal_data holds {sorted(unknown)}; this model takes 'image'",
                "multi_modal_data",
            )
        images = data.get("image", [])
        images = list(images) if isinstance(images, list | tuple) else [images]
        if self.max_images is not None and len(images) > self.max_images:
            raise InvalidRequestError(
                f"the prompt has {len(images)} images, more than limit_mm_per_prompt "
                f"{{'image': {self.max_images}}} allows",
                "image",
            )
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise InvalidRequestError("a prompt with images needs its text in 'prompt'", "prompt")
        pil = [_image(im, i, self.allowed_media_domains) for i, im in enumerate(images)]
        try:
            out = self.processor(text=text, images=pil or None, return_tensors="np")
        except ValueError as e:  # the processor's own check of placeholders and images
            msg = f"the prompt does not fit its images: {e}"
            raise InvalidRequestError(msg, "prompt") from None
        ids = [int(t) for t in out["input_ids"][0]]
        if "image_grid_thw" in out:  # images of any size: cut by each image's token count
            merge = self.processor.merge_size
            sizes = [t * h * w // merge**2 for t, h, w in out["image_grid_thw"].tolist()]
            runs = _cut_runs(_runs(ids, self.image_token_id), sizes)
        else:
            runs = _split_runs(_runs(ids, self.image_token_id), len(pil))
        if len(runs) != len(pil):
            raise InvalidRequestError(
                f"the prompt has {len(runs)} image placeholders "
                f"({self.processor.image_token!r}) for {len(pil)} images",
                "prompt",
            )
        if "image_grid_thw" in out:
            return text, ids, _grid_features(out, runs, self.processor.merge_size)
        pixels = out["pixel_values"] if pil else np.zeros((0,), np.float32)
        features = tuple(
            MultiModalFeature(_image_hash(pixels[i]), offset, length, pixels[i : i + 1])
            for i, (offset, length) in enumerate(runs)
        )
        return text, ids, features


def _cut_runs(runs: list[tuple[int, int]], sizes: list[int]) -> list[tuple[int, int]]:
    """Runs of placeholders cut, in order, into one span per image of `sizes` tokens
    (adjacent images of different sizes make one run); InvalidRequestError when the
    placeholders do not fall into those spans."""
    spans: list[tuple[int, int]] = []
    pending = list(reversed(sizes))
    for offset, length in runs:
        while length > 0 and pending and pending[-1] <= length:
            size = pending.pop()
            spans.append((offset, size))
            offset, length = offset + size, length - size
        if length:
            break
    if pending or len(spans) != len(sizes) or sum(sizes) != sum(n for _, n in runs):
        raise InvalidRequestError(
            f"the prompt's image placeholders ({sum(n for _, n in runs)} tokens in "
            f"{len(runs)} runs) do not match its {len(sizes)} images of {sizes} tokens",
            "prompt",
        )
    return spans


def _grid_features(
    out: dict[str, np.ndarray], runs: list[tuple[int, int]], merge: int
) -> tuple[MultiModalFeature, ...]:
    """Images of any size (Qwen2.5-VL): image i's patches are the next t * h * w rows
    of `pixel_values` `[P, D]`, its tokens a (t, h / merge, w / merge) grid."""
    features = []
    first = 0
    for (offset, length), (t, h, w) in zip(runs, out["image_grid_thw"].tolist(), strict=True):
        patches = out["pixel_values"][first : first + t * h * w][None]  # [1, P_i, D]
        first += t * h * w
        grid = (t, h // merge, w // merge)
        # The grid leads the hash: the prefix cache keys blocks on its first 16 digits.
        ident = _image_hash(patches.reshape(t, h, w, -1))
        features.append(MultiModalFeature(ident, offset, length, patches, grid))
    return tuple(features)


def media_domains(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """`allowed_media_domains` as given (a list, or one string of names separated by
    commas or spaces) as a tuple of domain names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(d for d in value.replace(",", " ").split() if d)
    return tuple(value)


# Content-part types that carry an image: OpenAI's image_url, and vLLM's offline image_pil.
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def split_image_parts(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages as templates take them, each image content part made
    `{"type": "image"}` (what vision models' templates expand to their image token), and
    the images in order: an `image_url`'s URL (`{"url": ...}` or the string), an
    `image_pil`'s PIL image."""
    images: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "image_url":
                url = part["image_url"]
                images.append(url["url"] if isinstance(url, dict) else url)
            elif kind in ("image_pil", "image") and part.get(kind) is not None:
                images.append(part[kind])
            if kind in IMAGE_PART_TYPES:
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def check_text_only(prompt: Any) -> None:
    """A prompt with images for a model that takes none: InvalidRequestError."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        raise InvalidRequestError(
            "this model takes text only: multi_modal_data (images) is not supported",
            "multi_modal_data",
        )


def tokenize_prompt(
    prompt: Any,
    processor: MultiModalProcessor | None,
    tokenize: Callable[[Any], tuple[str | None, list[int]]],
) -> tuple[str | None, list[int], tuple[MultiModalFeature, ...]]:
    """A prompt's text, token ids and images: a prompt with `multi_modal_data` through
    the model's processor (InvalidRequestError for a text-only model), the rest through
    `tokenize` (the engine's)."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        if processor is None:
            check_text_only(prompt)
        assert processor is not None
        return processor.process(prompt)
    return (*tokenize(prompt), ())


def block_mm_keys(request: Request, start: int, stop: int) -> list[int]:
    """The hash of each image with a placeholder token in positions [start, stop): a
    prefix-cache block's tokens are followed by these, in its hash and its verification."""
    if not request.mm_features:
        return []
    return [
        int(f.identifier[:16], 16)
        for f in request.mm_features
        if f.offset < stop and start < f.offset + f.length
    ]


def with_mm_features(sched: SchedulerOutput, running: Iterable[Request]) -> SchedulerOutput:
    """`sched` with the images each row's new tokens cover (`mm_features`); for an
    M-RoPE model (images with a token grid), every image before the row's end, whose
    sizes shift the row's positions."""
    by_id = {r.request_id: r for r in running if r.mm_features}
    covered: dict[str, tuple[MultiModalFeature, ...]] = {}
    for row in sched.scheduled:
        request = by_id.get(row.request_id)
        if request is None:
            continue
        lo, hi = row.start_position, row.start_position + len(row.token_ids)
        if request.mm_features[0].token_grid is not None:  # M-RoPE: every image before hi
            hit = tuple(f for f in request.mm_features if f.offset < hi)
        else:
            hit = tuple(
                f for f in request.mm_features if f.offset < hi and lo < f.offset + f.length
            )
        if hit:
            covered[row.request_id] = hit
    return dataclasses.replace(sched, mm_features=covered) if covered else sched
