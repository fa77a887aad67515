"""The file-system KV tier below the host tier, end to end against Transformers.

A long prefix evicted from the device and then from the host tier is read back from
its block files (outputs equal Transformers' greedy ones); a new engine on the same
directory hits it; a truncated or altered file is a miss, and outputs stay exact.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.testclient import TestClient

from jvllm import LLM, SamplingParams
from jvllm.disagg.proxy import build_proxy_app
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.kv.prefix import ROOT_HASH, hash_block_tokens
from jvllm.engine_args import EngineArgs
from jvllm.kv_offload.config import parse_kv_transfer_config
from jvllm.kv_offload.fs_store import HEADER
from jvllm.kv_offload.setup import flush_fs_tier
from jvllm.server.app import build_app
from jvllm.server.metrics import ServerMetrics
from jvllm.server.serving import ServingContext
from tests.helpers import hf_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
BLOCK = 16
# 33 usable device blocks: one flusher's 31 full blocks evict a whole prefix; a host
# tier of 19 blocks (8 KiB each) loses it to the next flusher.
ENGINE = dict(
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    num_gpu_blocks_override=34,
    kv_offloading_size=0.00015,
)


def _random(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(6, 512, size=n)]


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    shared = _random(rng, 200)
    return {
        "a": shared + _random(rng, 5),
        "b": shared[:40] + _random(rng, 150),
        "flush1": _random(rng, 470),
        "flush2": _random(rng, 470),
    }


@pytest.fixture(scope="module")
def reference(hf_models, prompts, tokenizer_dir) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    model = hf_models["llama"]
    return {name: hf_greedy(model, ids, NEW_TOKENS, eos) for name, ids in prompts.items()}


def _generate(llm: LLM, ids: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _tier(llm: LLM):
    return llm.engine.scheduler.kv_cache_manager.disk_tier


def _block_file(llm: LLM, ids: list[int], index: int):
    """The file of full block `index` of prompt `ids`."""
    parent = ROOT_HASH
    for i in range(index + 1):
        tokens = tuple(ids[i * BLOCK : (i + 1) * BLOCK])
        parent = hash_block_tokens(parent, tokens)
    return llm.engine.kv_transfer.store.path(_tier(llm).key(parent, tokens))


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv_offload")


def _evict_to_disk_and_read_back(llm: LLM, prompts, reference) -> None:
    """Runs a, b and two flushers (a's blocks leave the device, then the host tier),
    then a again: all its full blocks come from disk."""
    tier = _tier(llm)
    assert llm.get_metrics()["num_tier_blocks"] == 19
    for name in ("a", "b", "flush1", "flush2"):
        assert _generate(llm, prompts[name]) == reference[name], name
    flush_fs_tier(llm.engine)
    # a's 12 full blocks and b's own went to disk as the device evicted them.
    assert tier.num_written_blocks >= 12 and tier.num_blocks == tier.num_written_blocks
    host_hits = llm.get_metrics()["prefix_cache_host_hits"]
    assert _generate(llm, prompts["a"]) == reference["a"]
    # None of a's blocks was on the device or in the host tier: all 12 came from disk.
    assert tier.num_read_blocks == 12 and tier.num_failed_reads == 0
    assert llm.get_metrics()["prefix_cache_host_hits"] - host_hits == 12 * BLOCK


def test_prefix_comes_back_from_disk(checkpoints, prompts, reference, offload_dir):
    llm = LLM(str(checkpoints["llama"]), kv_offload_dir=str(offload_dir), **ENGINE)
    _evict_to_disk_and_read_back(llm, prompts, reference)


def test_tensor_parallel_blocks_are_whole(checkpoints, prompts, reference, offload_dir, tmp_path):
    """Under TP=2 each file holds the whole block (every device's heads): the same
    layout, so the same sub-directory, as one device's."""
    # A host block holds both devices' halves: half the GiB per device, 19 blocks.
    engine = {**ENGINE, "kv_offloading_size": ENGINE["kv_offloading_size"] / 2}
    llm = LLM(
        str(checkpoints["llama"]), kv_offload_dir=str(tmp_path), tensor_parallel_size=2, **engine
    )
    _evict_to_disk_and_read_back(llm, prompts, reference)
    store = llm.engine.kv_transfer.store
    assert [d.name for d in offload_dir.iterdir()] == [store.directory.name]


def test_new_engine_hits_the_directory_and_corrupt_files_miss(
    checkpoints, prompts, reference, offload_dir
):
    # vLLM's spelling this time: the same host tier, in bytes, and the same directory.
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 19 * 8192,
            "secondary_tiers": [{"type": "fs", "root_dir": str(offload_dir)}],
        },
    }
    engine = {**ENGINE, "kv_offloading_size": 0.0}
    llm = LLM(str(checkpoints["llama"]), kv_transfer_config=config, **engine)
    tier = _tier(llm)
    assert llm.get_metrics()["num_tier_blocks"] == 19
    assert tier.num_blocks >= 12  # found at start
    truncated = _block_file(llm, prompts["a"], 5)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    altered = _block_file(llm, prompts["b"], 2)  # holds b's tokens past the shared 40
    data = bytearray(altered.read_bytes())
    data[HEADER.size + 100] ^= 0x40
    altered.write_bytes(bytes(data))
    assert _generate(llm, prompts["a"]) == reference["a"]
    metrics = llm.get_metrics()
    # a: blocks 0-4 hit from disk, 5 is a miss, so 5-11 are computed (6-11 were read
    # but hang off the missing block).
    assert tier.num_failed_reads == 1 and not truncated.exists()
    assert metrics["prefix_cache_hits"] == 5 * BLOCK
    assert _generate(llm, prompts["b"]) == reference["b"]
    assert tier.num_failed_reads == 2 and not altered.exists()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"kv_connector": "LMCacheConnectorV1"}, "kv_connector 'LMCacheConnectorV1'"),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}, "kv_role"),
        ({"kv_connector": "SocketConnector", "kv_role": "kv_both"}, "kv_role 'kv_both'"),
        ({"kv_connector": "SocketConnector", "kv_role": "kv_consumer", "kv_port": -2}, "kv_port"),
        (
            {
                "kv_connector": "OffloadingConnector",
                "kv_connector_extra_config": {"secondary_tiers": [{"type": "s3"}]},
            },
            "secondary_tiers",
        ),
        (
            {
                "kv_connector": "OffloadingConnector",
                "kv_connector_extra_config": {
                    "cpu_bytes_to_use": -1,
                    "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x"}],
                },
            },
            "cpu_bytes_to_use -1",
        ),
    ],
)
def test_bad_kv_transfer_config_is_named(config, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(config)


def test_the_fs_tier_needs_a_host_tier(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="below the prefix cache's host tier"):
        LLM(str(checkpoints["llama"]), kv_offload_dir=str(tmp_path), max_model_len=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    """A jvllm server app on a localhost port, in a thread of this process."""

    def __init__(self, engine_args: EngineArgs) -> None:
        engine = engine_args.create_engine()
        self.tier = engine.scheduler.kv_cache_manager.disk_tier
        self.engine = engine
        ctx = ServingContext(AsyncLLM(engine), ["m"], engine_args.model)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(ctx, ServerMetrics()), port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread ended before it started"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_disaggregated_prefill_through_the_proxy(checkpoints, prompts, reference, tokenizer_dir):
    """A prefill server (kv_producer) computes the prompt (max_tokens=1, as vLLM's
    example) and sends its blocks over a local socket; the decode server (kv_consumer)
    hits all of them; through the proxy the answer is Transformers' greedy one and
    one server's."""
    from transformers import AutoTokenizer

    port = _free_port()
    config = {"kv_connector": "SocketConnector", "kv_ip": "127.0.0.1", "kv_port": port}
    path = str(checkpoints["llama"])
    decode = _Served(
        EngineArgs(path, kv_transfer_config={**config, "kv_role": "kv_consumer"}, **ENGINE)
    )
    prefill = _Served(
        EngineArgs(path, kv_transfer_config={**config, "kv_role": "kv_producer"}, **ENGINE)
    )
    expected = AutoTokenizer.from_pretrained(tokenizer_dir).decode(reference["a"])
    body = {"model": "m", "prompt": prompts["a"], "max_tokens": NEW_TOKENS, "temperature": 0}
    try:
        with TestClient(build_proxy_app([prefill.url], [decode.url])) as proxy:
            answer = proxy.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            text = answer.json()["choices"][0]["text"]
            # The detokenizer holds back a trailing partial character: a prefix of it.
            assert text and expected.startswith(text)
            # Sent before the prefill server answered: the decode server read them all.
            assert prefill.tier.num_written_blocks == 12
            assert decode.tier.num_read_blocks == 12
            streamed = proxy.post("/v1/completions", json={**body, "stream": True})
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
            pieces = [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]
            assert "".join(pieces) == text and events[-1] == "[DONE]"
            # One server alone (the prefill server, from its own cache) answers the same.
            alone = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60)
            assert alone.json()["choices"][0]["text"] == text
            assert proxy.post("/v1/completions", content=b"{").status_code == 400
    finally:
        prefill.stop()
        decode.stop()
        decode.engine.kv_transfer.receiver.close()
