"""Reading Triton kernels out of compiled HLO text (no plugin, no ptxas needed)."""

from __future__ import annotations

import zlib

from jvllm.testing import triton_ptx


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _message(*fields: tuple[int, int | bytes]) -> bytes:
    out = b""
    for number, value in fields:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            out += _varint(number << 3 | 2) + _varint(len(value)) + value
    return out


def _c_escape(data: bytes) -> str:
    """Like HLO text's CEscape: printable ASCII as is, the rest as octal escapes."""
    safe = lambda b: 32 <= b < 127 and b not in b'"\\'
    return "".join(chr(b) if safe(b) else f"\\{b:03o}" for b in data)


def test_kernel_and_operands_come_back_from_a_custom_call_line():
    ptx = b"//\n.version 8.7\n.target sm_90a\n.entry paged_attention_kernel()\n" * 40
    kernel = _message((1, b"paged_attention_kernel"), (2, 4), (3, 39168), (4, ptx), (6, 90))
    config = zlib.compress(_message((1, _message((1, kernel), (2, 80), (3, 8), (4, 1)))))
    line = (
        "  %triton_kernel_call.4 = (f32[2,64,32,128]{3,2,1,0}) custom-call(%q, %k), "
        'custom_call_target="triton_kernel_call", operand_layout_constraints='
        "{bf16[64,32,128]{2,1,0}, bf16[1000,16,8,128]{3,2,1,0}}, api_version=API_VERSION_TYPED"
        f'_FFI, backend_config="{_c_escape(config)}"'
    )
    other = '  %fusion = f32[4]{0} fusion(%p), kind=kLoop, backend_config="{}"'
    (call,) = triton_ptx.triton_calls(f"{other}\n{line}\n{other}")
    assert call.kernel_name == "paged_attention_kernel"
    assert call.operands == ("bf16[64,32,128]", "bf16[1000,16,8,128]")
    assert (call.num_warps, call.dynamic_shared_bytes, call.ptx) == (4, 39168, ptx)


def test_problems_name_spills_and_shared_memory_overflow():
    report = triton_ptx.KernelReport("k", (), 4, 255, 552, 284672, 232448)
    assert report.problems == ["spills 552 bytes", "needs 284672 B shared memory > 232448 B"]
    assert report._replace(spill_bytes=0, shared_bytes=1024).problems == []
