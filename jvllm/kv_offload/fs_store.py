"""FsBlockStore: KV blocks as files, one per block, that a restart or another process reads.

Owns the file format and the directory: `<root_dir>/<layout>/<key>.kv`, where
`layout` names the model, dtype, block size and KV layout (`layout_fingerprint`) and
`key` a block's prefix content (the engine's `DiskPrefixTier.key`). A file is a
header (magic, key, layout digest, payload length, CRC-32 of the payload) and the
payload, the block's raw K/V bytes. Writes go to a temporary name and are renamed
into place (`os.replace`), so a reader sees a whole file or none; a file whose header
or checksum does not match what is asked is a miss and is deleted, never K/V.
It knows nothing of host memory or the prefix cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

from jvllm.kv_offload.connector import KVConnectorBase

MAGIC = b"JVLLMKV1"
# magic, key (32 bytes), layout digest (32 bytes), payload bytes, CRC-32 of the payload.
HEADER = struct.Struct("<8s32s32sQI")
SUFFIX = ".kv"


def layout_fingerprint(identity: dict[str, Any]) -> bytes:
    """The 32-byte digest of what makes two processes' blocks interchangeable: the model
    (its path and the size and time of its files), dtype, block size, the host layout
    of a block's layers, and the Python version (block hashes use its tuple hash)."""
    model = identity.get("model")
    if isinstance(model, str) and os.path.isdir(model):
        files = sorted(Path(model).iterdir())
        identity = dict(
            identity,
            model=os.path.abspath(model),
            files=[(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        )
    identity = dict(identity, python=list(sys.version_info[:2]), format=MAGIC.decode())
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def frame_header(key: str, fingerprint: bytes, payload: bytes | memoryview) -> bytes:
    """The header a block's bytes are stored (or sent) behind."""
    return HEADER.pack(MAGIC, bytes.fromhex(key), fingerprint, len(payload), zlib.crc32(payload))


def checked_key(header: bytes, payload: bytes, fingerprint: bytes, num_bytes: int) -> str | None:
    """The key a header names when it and the payload are intact and of this layout."""
    if len(header) != HEADER.size:
        return None
    magic, key, layout, length, crc = HEADER.unpack(header)
    intact = magic == MAGIC and layout == fingerprint and length == num_bytes == len(payload)
    return key.hex() if intact and zlib.crc32(payload) == crc else None


class FsBlockStore(KVConnectorBase):
    def __init__(self, root_dir: str | Path, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        self.directory = Path(root_dir) / fingerprint.hex()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def scan(self) -> list[str]:
        """Keys of the files present, least recently used (oldest mtime) first; left-over
        temporary files of an interrupted write are deleted."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX):
                found.append((entry.stat().st_mtime_ns, entry.name[: -len(SUFFIX)]))
            elif ".tmp" in entry.name:
                _unlink(entry.path)
        return [key for _, key in sorted(found)]

    def lookup(self, key: str) -> bool:
        return self.path(key).is_file()

    def save_block(self, key: str, payload: bytes | memoryview) -> None:
        header = frame_header(key, self.fingerprint, payload)
        final = self.path(key)
        temp = final.with_name(f"{final.name}.tmp{os.getpid()}.{threading.get_ident()}")
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, final)
        except BaseException:
            _unlink(temp)
            raise

    def load_block(self, key: str, num_bytes: int) -> bytes | None:
        """The block's payload, or None (and the file deleted) when it is missing,
        truncated, altered, or another key's, layout's or size's."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(HEADER.size + num_bytes + 1)
        except OSError:
            return None
        payload = data[HEADER.size :]
        if checked_key(data[: HEADER.size], payload, self.fingerprint, num_bytes) == key:
            os.utime(path)  # most recently used, for the next start's LRU order
            return payload
        _unlink(path)
        return None

    def delete_block(self, key: str) -> None:
        _unlink(self.path(key))


def _unlink(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
