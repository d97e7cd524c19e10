"""Runs vLLM (with the kdaserve plugin installed) on a checkpoint and prints what it generated as one
JSON line: `python vllm_runner.py REQUEST.json` under the vLLM venv's python (tests/integrations/
test_vllm_plugin*.py). The request names the model, dtype, tensor_parallel_size,
max_num_batched_tokens, the prompts (token ids), max_tokens, prompt_logprobs, additional_config,
speculative_config and, for a GLM checkpoint, `probe_hidden` (hidden states whose projections and
KDA weights each plugin layer reports)."""

import json
import os
import sys

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")          # keep vLLM's sockets on loopback
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")           # the CUDA-only fused GEMM paths
os.environ.setdefault("VLLM_ENABLE_GEMM_RS", "0")
# collective_rpc with a function (which KDA class each worker built) needs pickle; local test runs only.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _kda_layer_classes(worker) -> list[str]:
    """In a worker: the class of every KDA layer of its model (which class vLLM really built)."""
    model = worker.model_runner.model
    return sorted({type(m).__name__ for m in model.modules() if "GatedDeltaNet" in type(m).__name__
                   or "KDA" in type(m).__name__})


def _glm_kda_probe(worker, hidden: list) -> dict:
    """In a worker: per GLM KDA layer of the plugin, its projections of `hidden` and the weights it
    hands kdaserve (KDAWeights), as lists."""
    import torch

    out = {}
    for m in worker.model_runner.model.modules():
        if type(m).__name__ != "KdaserveGlmKDA":
            continue
        with torch.no_grad():
            qkv, g1, beta, g2 = m.kdaserve_project(torch.tensor(hidden, dtype=m.o_norm.weight.dtype))
            w = m._kda_weights()
        tensors = dict(qkv=qkv, forget=g1[0], beta=beta[0], gate=g2, conv_weight=w.conv_weight, A_log=w.A_log,
                       dt_bias=w.dt_bias, norm_weight=w.norm_weight)
        out[m.prefix] = {k: t.float().flatten().tolist() for k, t in tensors.items()} | {
            "lower_bound": w.lower_bound, "norm_eps": w.norm_eps, "vllm_prefill": m.kda_prefill_backend,
            "tp_rank": m.tp_rank, "tp_size": m.tp_size,
            "checkpoint_alignment": m.get_kv_cache_spec(worker.vllm_config).prefill_checkpoint_alignment}
    return out


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.load(open(sys.argv[1]))
    if req.get("tp", 1) == 1:   # one process: the engine core and the worker in this one (each process
        # of vLLM's own costs CI ~10 s of imports); two ranks keep vLLM's processes
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=req["model"], disable_log_stats=False, dtype=req.get("dtype", "float32"), max_model_len=256,
              tensor_parallel_size=req.get("tp", 1),
              skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.3,
              enable_prefix_caching=req.get("enable_prefix_caching", False), **req.get("engine_args", {}),
              max_num_batched_tokens=req.get("max_num_batched_tokens", 256), max_num_seqs=8,
              additional_config=req.get("additional_config"), max_logprobs=req.get("max_logprobs", 20),
              speculative_config=req.get("speculative_config"),
              **({"distributed_executor_backend": "uni"} if req.get("tp", 1) == 1 else {}))
    params = SamplingParams(max_tokens=req["max_tokens"], temperature=0, ignore_eos=True, detokenize=False,
                            prompt_logprobs=req.get("prompt_logprobs"), logprobs=req.get("logprobs"))
    outs = []
    for group in req.get("waves") or [req["prompts"]]:   # waves run one after another (prefix-cache hits)
        outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        entry = {"tokens": list(c.token_ids)}
        if o.prompt_logprobs is not None:   # per position: {token id: logprob}; position 0 has none
            entry["prompt_logprobs"] = [None if d is None else {str(k): v.logprob for k, v in d.items()}
                                        for d in o.prompt_logprobs]
        if c.logprobs is not None:
            entry["logprobs"] = [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs]
        result.append(entry)
    classes = llm.collective_rpc(_kda_layer_classes)   # one list per worker (tensor-parallel rank)
    probe = llm.collective_rpc(_glm_kda_probe, args=(req["probe_hidden"],)) if req.get("probe_hidden") else None
    hits = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    print("RESULT " + json.dumps({"outputs": result, "kda_classes": classes, "prefix_cache_hits": hits,
                                  "glm_probe": probe}), flush=True)


if __name__ == "__main__":
    main()
