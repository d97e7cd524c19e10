"""GLM-5.3-Flash's first 4 layers at full width (3 KDA + 1 DSA, dense MLPs then one 288-expert MoE,
hyper-connections around every sublayer), random bf16 weights: prefill and decode time per layer
part against each part's memory floor (decode) and tensor-core floor (prefill), for several KDA
backend pairs.

    PYTHONPATH=$PWD python3 benchmarks/bench_glm_layers.py [--pairs flash,fused fla,fla] [--prompt 8192] [--batches 1 64]

Method: the engine in eager mode (so each sublayer can be timed) on a config written to a temporary
directory (transformers' GLM-5.3-Flash values, num_hidden_layers = 4), `--load-format dummy`.
Each part (mixer = KDA or DSA attention; MLP; mHC = both hyper-connections with their updates) is
timed with CUDA events around its forward, summed per layer kind; the median of `--repeats` runs
after a warm-up run. Prefill: one `--prompt`-token prompt. Decode: B sequences with
`--decode-ctx`-token prompts, one step.
Floors: decode = bytes the part must read (its parameters, the routed experts touched by B tokens
under uniform routing, the KDA state read and written, the MLA latent and indexer rows of every
context) / measured copy bandwidth; prefill = 2 x parameters x tokens (for the MoE: the k experts
of every token) / 989 TFLOP/s (H200 bf16 dense). Rows print as measured; the table prints last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_throughput import copy_bandwidth  # noqa: E402
from kdaserve.engine import LLM, SamplingParams  # noqa: E402
from kdaserve.models.glm5_next_config import Glm5NextConfig  # noqa: E402

PEAK_BF16 = 989e12


def slice_config(layers: int) -> dict:
    c = Glm5NextConfig(num_hidden_layers=layers, eos_token_id=256, max_position_embeddings=65536)
    return {**c.to_dict(), "model_type": "glm5_next_text"}


class PartTimer:
    """CUDA events around each part's forward, per (layer kind, part)."""

    def __init__(self, model):
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False
        for layer in model.model.layers:
            kind = "KDA" if layer.is_kda else "DSA"
            for part, modules in (("mixer", [layer.self_attn]), ("MLP", [layer.mlp]), ("mHC", [layer.attn_hc, layer.ffn_hc])):
                for m in modules:
                    self._hook(m, f"{kind} {part}")

    def _hook(self, module, key):
        def pre(_m, _a):
            if self.on:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.events.append((key, e, None))

        def post(_m, _a, _o):
            if self.on:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                k, s, _ = self.events.pop()
                self.events.append((k, s, e))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def collect(self) -> dict[str, float]:
        torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for key, s, e in self.events:
            out[key] += s.elapsed_time(e)
        self.events.clear()
        return out


def part_params(model) -> dict[str, int]:
    """Parameter bytes per (kind, part), experts apart."""
    out: dict[str, int] = defaultdict(int)
    for layer in model.model.layers:
        kind = "KDA" if layer.is_kda else "DSA"
        out[f"{kind} mixer"] += sum(p.numel() * p.element_size() for p in layer.self_attn.parameters())
        out[f"{kind} mHC"] += sum(p.numel() * p.element_size() for m in (layer.attn_hc, layer.ffn_hc) for p in m.parameters())
        out[f"{kind} MLP"] += sum(p.numel() * p.element_size() for n, p in layer.mlp.named_parameters()
                                  if n not in ("w13", "w2"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["flash,fused", "fla,fla"], help="prefill,decode KDA backend pairs")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--decode-ctx", type=int, default=512, help="prompt tokens of the decode batches")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} | copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    ckpt = Path(tempfile.mkdtemp()) / "glm5_next_4_layers"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(slice_config(4)))
    rows = []
    for pair in args.pairs:
        prefill_backend, decode_backend = pair.split(",")
        try:
            llm = LLM(str(ckpt), load_format="dummy", enforce_eager=True, warmup=False, max_num_seqs=max(args.batches),
                      max_model_len=max(args.prompt, args.decode_ctx) + 64, max_num_batched_tokens=args.prompt,
                      kda_prefill_backend=prefill_backend, kda_decode_backend=decode_backend)
        except (ValueError, RuntimeError) as exc:
            print(f"{pair}: cannot build: {exc}", flush=True)
            continue
        model = llm.engine.runner.model
        c = model.config
        timer = PartTimer(model)
        params = part_params(model)
        gen = torch.Generator().manual_seed(0)

        def prompts(n, length):
            return [torch.randint(1, 250, (length,), generator=gen).tolist() for _ in range(n)]

        one = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate(prompts(1, args.prompt), one, use_tqdm=False)   # compile
        runs = []
        for _ in range(args.repeats):
            timer.on = True
            llm.generate(prompts(1, args.prompt), one, use_tqdm=False)
            timer.on = False
            runs.append(timer.collect())
        for key in sorted(runs[0]):
            ms = statistics.median(r[key] for r in runs)
            layers = sum((not l.is_kda) == key.startswith("DSA") for l in model.model.layers)
            flops = 2 * args.prompt * params[key] / 2
            if key.endswith("MLP") and key.startswith("DSA"):   # the MoE layer: k routed experts per token
                flops += 2 * args.prompt * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
            floor = flops / PEAK_BF16 * 1e3
            rows.append((pair, f"prefill {args.prompt}", key, layers, ms, floor))
            print(f"{pair} prefill {args.prompt}: {key} ({layers} layers) {ms:.3f} ms, tensor floor {floor:.3f} ms", flush=True)
        for B in args.batches:
            two = SamplingParams(max_tokens=2, ignore_eos=True)
            runs = []
            for _ in range(args.repeats):
                # The prompts prefill in the first step(s); time the decode step that follows.
                started: set[str] = set()
                for i, p in enumerate(prompts(B, args.decode_ctx)):
                    llm.engine.add_request(f"r{len(runs)}-{i}", p, two)
                while len(started) < B:
                    started |= {o.request_id for o in llm.engine.step() if o.output_token_ids}
                timer.on = True
                while llm.engine.has_unfinished_requests():
                    llm.engine.step()
                timer.on = False
                runs.append(timer.collect())
            expert_bytes = 3 * c.hidden_size * c.moe_intermediate_size * 2
            touched = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** B)
            for key in sorted(runs[0]):
                ms = statistics.median(r[key] for r in runs)
                layers = sum((not l.is_kda) == key.startswith("DSA") for l in model.model.layers)
                nbytes = params[key]
                if key == "DSA MLP":
                    nbytes += touched * expert_bytes
                if key == "KDA mixer":
                    nbytes += layers * 2 * B * c.linear_num_heads * c.linear_head_dim ** 2 * 4
                if key == "DSA mixer":
                    nbytes += layers * B * (args.decode_ctx + 1) * (c.kv_lora_rank + 2 * c.index_head_dim) * 2
                floor = nbytes / bw * 1e3
                rows.append((pair, f"decode B={B}", key, layers, ms, floor))
                print(f"{pair} decode B={B}: {key} {ms:.3f} ms, memory floor {floor:.3f} ms", flush=True)
        del llm
        torch.cuda.empty_cache()
    print(f"\nGLM-5.3-Flash layers 0-3 at full width (3 KDA + 1 DSA; dense MLP x3, MoE x1), random bf16 weights, "
          f"eager engine, CUDA events per part, median of {args.repeats}")
    print("| backends | step | part | layers | ms | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|")
    for pair, step, key, layers, ms, floor in rows:
        print(f"| {pair} | {step} | {key} | {layers} | {ms:.3f} | {floor:.3f} | {ms / floor:.1f}x |")


if __name__ == "__main__":
    main()
