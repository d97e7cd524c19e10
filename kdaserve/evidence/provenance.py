"""What ran in one arm of an A/B: the backends the engine resolved to and the kernels (on a CPU,
the ops) of a short profiled generation, so an A/B cannot silently compare one path with itself.
Run as `python -m kdaserve.evidence.provenance REQUEST.json ANSWER.json` (bench/ab.py does), so the
engine's memory is given back when the process ends."""

from __future__ import annotations

import json
import sys
from collections import Counter


def provenance(model: str, flags: str, prompts: list[list[int]]) -> dict:
    import torch

    from kdaserve.engine import LLM, SamplingParams
    from kdaserve.engine.args import engine_kwargs_from_flags

    llm = LLM(**engine_kwargs_from_flags(model, flags))
    runner = llm.engine.runner
    backends = {"kda_prefill": runner.kda_backends.prefill.name if runner.kda_backends else None,
                "kda_decode": runner.kda_backends.decode.name if runner.kda_backends else None,
                "mla": llm.engine.config.mla_backend, "moe": llm.engine.config.moe_backend,
                "cuda_graphs": runner.graphs is not None, "device": str(llm.engine.config.device)}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)   # compile outside the profile
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = llm.engine.config.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
    counts: Counter = Counter()
    for e in prof.events():
        is_kernel = e.device_type == torch.autograd.DeviceType.CUDA
        if (cuda and is_kernel) or (not cuda and e.name.startswith("aten::")):
            counts[e.name] += 1
    # Every kernel, not a top few: in a large model the backend's own kernels are far down the list.
    return {"backends": backends, "kind": "CUDA kernels" if cuda else "CPU ops",
            "kernels": [{"name": n, "calls": c} for n, c in counts.most_common()]}


def main(argv: list[str]) -> int:
    request_path, answer_path = argv
    with open(request_path) as f:
        request = json.load(f)
    answer = provenance(request["model"], request["flags"], request["prompts"])
    with open(answer_path, "w") as f:
        json.dump(answer, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
