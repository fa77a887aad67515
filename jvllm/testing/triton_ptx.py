"""The Triton kernels inside a compiled XLA:GPU program, and what ptxas says of them.

Owns reading each `triton_kernel_call` custom call out of compiled HLO text (its operand
shapes, and the kernel jax-triton stored in its `backend_config`: a zlib-compressed
`TritonAnyKernelCall` protobuf holding the PTX, the warp count and Triton's dynamic
shared memory), and assembling that PTX with the ptxas shipped in the triton wheel
(`-v`: registers, spill bytes, static shared memory). A launch configuration that spills
or overflows shared memory still lowers and compiles; only this report catches it.
Not owned: which programs to compile (jvllm.testing.deviceless).
"""

from __future__ import annotations

import codecs
import re
import subprocess
import tempfile
import zlib
from pathlib import Path
from typing import NamedTuple

_CALL = 'custom_call_target="triton_kernel_call"'
_OPERANDS = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")
SHAPE = re.compile(r"\w+\[[\d,]*\]")
_CONFIG = re.compile(r'backend_config="((?:[^"\\]|\\.)*)"')
# Field numbers of jaxlib's triton.proto: TritonAnyKernelCall.kernel_call = 1,
# TritonKernelCall.kernel = 1, TritonKernel {kernel_name 1, num_warps 2, shared_mem_bytes 3, ptx 4}.
_KERNEL_CALL, _KERNEL, _NAME, _WARPS, _SHARED, _PTX = 1, 1, 1, 2, 3, 4


class TritonCall(NamedTuple):
    kernel_name: str
    operands: tuple[str, ...]  # HLO shapes as compiled, per device: "bf16[64,32,128]"
    num_warps: int
    dynamic_shared_bytes: int  # what Triton asks the launch for
    ptx: bytes


class KernelReport(NamedTuple):
    kernel_name: str
    operands: tuple[str, ...]
    num_warps: int
    registers: int  # per thread
    spill_bytes: int  # spill stores + spill loads
    shared_bytes: int  # Triton's dynamic shared memory + ptxas's static
    shared_limit: int  # the target's opt-in limit per block

    @property
    def problems(self) -> list[str]:
        out = []
        if self.spill_bytes:
            out.append(f"spills {self.spill_bytes} bytes")
        if self.shared_bytes > self.shared_limit:
            out.append(f"needs {self.shared_bytes} B shared memory > {self.shared_limit} B")
        return out


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes) -> dict[int, int | bytes]:
    """One protobuf message's fields (the last value of each number wins)."""
    out: dict[int, int | bytes] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        wire = key & 7
        if wire == 0:
            out[key >> 3], i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            out[key >> 3], i = data[i : i + size], i + size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
    return out


def triton_calls(hlo_text: str) -> list[TritonCall]:
    """Every Triton kernel launch in a compiled HLO module's text, in program order."""
    calls = []
    for line in hlo_text.splitlines():
        if _CALL not in line:
            continue
        operands = _OPERANDS.search(line)
        config = _CONFIG.search(line)
        assert operands and config, line[:200]
        # HLO text C-escapes the bytes; escape_decode undoes exactly that.
        raw = zlib.decompress(codecs.escape_decode(config.group(1).encode("latin-1"))[0])
        kernel = _fields(_fields(_fields(raw)[_KERNEL_CALL])[_KERNEL])
        calls.append(
            TritonCall(
                kernel[_NAME].decode(),
                tuple(SHAPE.findall(operands.group(1))),
                int(kernel.get(_WARPS, 0)),
                int(kernel.get(_SHARED, 0)),
                kernel[_PTX],
            )
        )
    return calls


def ptxas_path() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def assemble(call: TritonCall, arch: str, shared_limit: int) -> KernelReport:
    """Runs ptxas -v on the call's PTX for `arch` (e.g. sm_90a)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / f"{call.kernel_name}.ptx"
        ptx.write_bytes(call.ptx)
        cmd = [str(ptxas_path()), "-v", f"--gpu-name={arch}", str(ptx), "-o", f"{ptx}.cubin"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    log = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"ptxas failed on {call.kernel_name}: {log[-2000:]}")
    count = lambda pattern: sum(int(n) for n in re.findall(pattern, log))
    registers = re.search(r"Used (\d+) registers", log)
    assert registers, log
    return KernelReport(
        call.kernel_name,
        call.operands,
        call.num_warps,
        int(registers.group(1)),
        count(r"(\d+) bytes spill (?:stores|loads)"),
        call.dynamic_shared_bytes + count(r"(\d+) bytes smem"),
        shared_limit,
    )
