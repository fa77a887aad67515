#!/usr/bin/env bash
# One command for a lent NVIDIA GPU (the device tool's nvidia-h200: Python 3.12, jax 0.11,
# triton 3.6, torch preinstalled, no network): installs the carried wheels the image lacks
# (jax-triton at least) and jvllm itself, then runs the `gpu` tests, the decode-attention
# kernel benchmark and, when bench/throughput.py exists, the 8B throughput benchmark;
# prints a short table last, with the predictions that tests/gpu_compile made without a GPU
# (bench/results/deviceless_h200.json: kernel registers, spills and shared memory, KV-cache
# blocks) beside what this GPU reports, and XLA's memory_stats() beside the KV-cache budget
# jvllm plans from them. About 8 minutes; each step has a time limit.
#
# Here, once, from the repository root (.whl/ is git-ignored; the image has jax 0.11,
# triton 3.6 and absl-py, which is what jax-triton 0.3.1 needs):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl jax-triton==0.3.1
# Then with the device tool: run(command="bash bench/gpu_check.sh", carry=[".whl"],
# timeout_s=600). Logs and result JSON land in $OUT, which the tool brings back (without
# $OUT: logs in /tmp/gpu_check, results in bench/results/).
# Knobs: GPU_CHECK_BUDGET (seconds, default 480), THROUGHPUT_ARGS (default below).
set -uo pipefail
cd "$(dirname "$0")/.." || exit

BUDGET=${GPU_CHECK_BUDGET:-480}
THROUGHPUT_ARGS=${THROUGHPUT_ARGS:---preset 8b --num-prompts 256 --skip-hf}
LOGS=${OUT:-/tmp/gpu_check}
RESULTS=${OUT:-bench/results}
PY=${PYTHON:-python3}
mkdir -p "$LOGS" "$RESULTS"
export PYTHONUNBUFFERED=1
# Torch and JAX share the GPU: neither may take most of its memory up front. The memory
# and throughput steps drop this (OWNED): there jvllm sets XLA's allocator itself.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OWNED=(env -u XLA_PYTHON_CLIENT_PREALLOCATE)
unset TRITON_INTERPRET

SUMMARY=()
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs to $LOGS/NAME.log.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  SUMMARY+=("$(printf '%-12s %-8s %5ss' "$name" "$([ "$rc" = 0 ] && echo ok || echo "rc=$rc")" \
    $((SECONDS - t0)))")
}
left() { echo $((BUDGET - SECONDS)); }

if compgen -G ".whl/*.whl" >/dev/null; then
  step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ carried: jax-triton must already be installed" >&2
fi
# Editable; where it fails, `python -m pytest` and the bench scripts still import jvllm
# from this directory.
step install 120 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
step versions 60 "$PY" -c "
import jax, triton, torch
try:
    import jax_triton; jt = jax_triton.__version__
except Exception as e:
    jt = f'missing ({e})'
print(torch.cuda.get_device_name(), '| jax', jax.__version__, jax.devices(),
      '| triton', triton.__version__, '| torch', torch.__version__, '| jax-triton', jt)"
# XLA's allocator as LLM() sets it, memory_stats() beside the planned 8B budget.
step memory 90 "${OWNED[@]}" "$PY" bench/gpu_memory.py --output "$RESULTS/gpu_memory.json"
# The image lacks the server's packages; its tests are CPU tests, so leave them out then.
IGNORE=()
"$PY" -c "import starlette, pydantic, openai, uvicorn" 2>/dev/null || IGNORE=(--ignore=tests/server)
step gpu-tests 240 "$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider "${IGNORE[@]}" \
  --ignore=tests/kernels/test_triton_mla.py tests
# The MLA decode kernel at DeepSeek-V3's shapes against the reference, case by case.
step mla-kernel 120 "$PY" -m pytest -m gpu -v -rfEs -p no:cacheprovider tests/kernels/test_triton_mla.py
step kernel 240 "$PY" bench/kernel.py --sweep 256 --output "$RESULTS/kernel.json"
if [ "$(left)" -gt 330 ]; then
  # The demo model with and without n-gram lookup and its EAGLE head, at 1 and 4 sequences.
  step spec-decode 150 "$PY" bench/spec_decode.py --concurrency 1,4 --num-prompts 8 \
    --repeats 1 --max-tokens 64 --eagle demo --out "$RESULTS/spec_decode_gpu.json"
fi
if [ "$(left)" -gt 300 ]; then
  # How long the GPU waits for the host between steps at 256 decoding sequences.
  step device-idle 120 "$PY" bench/device_idle.py --output "$RESULTS/device_idle_gpu.json"
fi
if [ "$(left)" -gt 240 ]; then
  # A cold start (empty cache directory) then a warm one that loads the stored programs.
  step startup 150 "$PY" bench/startup.py --preset cpu --rounds 1 --warm 1 \
    --output "$RESULTS/startup_gpu.json"
fi
if [ "$(left)" -gt 240 ]; then
  # The sampler alone at Llama-3's vocabulary: jnp.argmax against argmax_rows here.
  step sampler 45 "$PY" bench/sampler.py --rows 64,256 --vocab 128256 --reps 20 \
    --output "$RESULTS/sampler_gpu.json"
fi
if [ "$(left)" -gt 240 ]; then
  # An 8-expert top-2 MoE model: jvllm against Transformers' generate on the GPU.
  step moe 150 "$PY" bench/moe.py --output "$RESULTS/moe_gpu.json"
fi
if [ -f bench/throughput.py ] && [ "$(left)" -gt 90 ]; then
  # shellcheck disable=SC2086  # THROUGHPUT_ARGS is a list of flags
  step throughput "$(($(left) - 20))" "${OWNED[@]}" "$PY" bench/throughput.py $THROUGHPUT_ARGS \
    --output "$RESULTS/throughput_8b.json"
elif [ -f bench/throughput.py ]; then
  SUMMARY+=("throughput   skipped  (under 90 s left of GPU_CHECK_BUDGET=$BUDGET)")
fi

echo
echo "=== gpu tests"
grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|error)" "$LOGS/gpu-tests.log" | tail -8
echo "=== MLA decode kernel (DeepSeek-V3 shapes): this GPU's test | deviceless ptxas prediction"
grep -E "(PASSED|FAILED|SKIPPED|ERROR)" "$LOGS/mla-kernel.log" | tail -4
"$PY" -c "import json
for k in json.load(open('bench/results/mla_kernel_deviceless_h200.json'))['kernels']:
    print(f\"  {k['label']:24} {k['kernel_name']:20} {k['registers']} regs \"
          f\"{k['spill_bytes']} B spilled {k['shared_bytes']} B smem\")"
echo "=== kernel: decode attention, bf16, 32/8 heads, head_dim 128 (goal: batch 256, ctx 4096 >= 80%)"
if [ -f "$RESULTS/kernel.json" ]; then
  "$PY" -c "import json, sys; sys.path.insert(0, '.'); from bench import kernel
print(kernel.report(json.load(open('$RESULTS/kernel.json'))))"
else
  tail -5 "$LOGS/kernel.log"
fi
echo "=== device memory: memory_stats() | planned budget (bench/gpu_memory.py)"
sed -n '/^ *figure /,$p' "$LOGS/memory.log" | head -11
grep -h "Device memory:" "$LOGS/throughput.log" 2>/dev/null | tail -1
echo "=== deviceless predictions (tests/gpu_compile, no GPU) | this GPU"
timeout 120 "$PY" bench/gpu_predictions.py --throughput "$RESULTS/throughput_8b.json" 2>&1 |
  tee "$LOGS/predictions.log" | grep -v "^W\|^I0"
if [ -f "$LOGS/sampler.log" ]; then
  echo "=== sampler alone, vocabulary 128256 (median ms a call)"
  grep -A16 "^ *case " "$LOGS/sampler.log" | tail -16
fi
if [ -f "$LOGS/device-idle.log" ]; then
  echo "=== device idle under async scheduling (goal: at most 10% at 256 sequences)"
  grep "device idle" "$LOGS/device-idle.log" | tail -1
fi
if [ -f "$LOGS/startup.log" ]; then
  echo "=== start-up, cpu preset on this GPU (LLM() seconds, cold and warm)"
  sed -n '/source  *start/,$p' "$LOGS/startup.log" | head -5
fi
if [ -f "$LOGS/spec-decode.log" ]; then
  echo "=== speculative decoding, demo model (tokens/s, acceptance)"
  sed -n '/concurrency  *proposer/,$p' "$LOGS/spec-decode.log" | head -10
fi
echo "=== steps ($((SECONDS))s in all)"
printf '%s\n' "${SUMMARY[@]}"
