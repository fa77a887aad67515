"""One process of the two-process tests (run by test_multihost.py): argv is the model,
the coordinator address, this process's id, the output file, and optionally the
tensor- and pipeline-parallel sizes (default 4 and 1) and "ep" for expert parallelism."""

from __future__ import annotations

import json
import sys

from jvllm import LLM, SamplingParams


def main() -> None:
    model, address, process_id, out_file = sys.argv[1:5]
    tp, pp = (int(a) for a in sys.argv[5:7]) if len(sys.argv) > 5 else (4, 1)
    expert_parallel = sys.argv[7:8] == ["ep"]
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=expert_parallel,
        coordinator_address=address,
        num_processes=2,
        process_id=int(process_id),
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    prompts = json.loads(sys.stdin.read())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with open(out_file, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)


if __name__ == "__main__":
    main()
