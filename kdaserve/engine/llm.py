"""Offline batch generation on top of LLMEngine."""

from __future__ import annotations

import time

from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine.outputs import RequestOutput
from kdaserve.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "tiny", **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self.engine.output.incremental_text = False   # only final outputs are returned
        self.tokenizer = self.engine.tokenizer
        self.last_run_stats: dict = {}

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | dict | list[dict],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. `last_run_stats` then holds
        the prefill and decode token counts and throughput of this call. A prompt is text, token
        ids, or vLLM's dict: {"prompt": text} or {"prompt_token_ids": ids}, with
        "multi_modal_data": {"image": an image or a list of them} (PIL images; the prompt holds one
        image placeholder token per image, as the chat template writes it)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; expected one or one per prompt")
        parsed = [self._prompt(p) for p in prompts]
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        requests = []
        for (toks, images), sp in zip(parsed, params_list):   # all or nothing: check every request first
            toks, placed = self.engine.place_images(toks, images)   # placed images keep their hashes in add_request
            self.engine.validate_request(toks, sp)
            requests.append((toks, placed, sp))
        for rid, (toks, placed, sp) in zip(ids, requests):
            self.engine.add_request(rid, toks, sp, images=list(placed) or None)
        return self._run(ids, use_tqdm)

    def _prompt(self, p) -> tuple[list[int], list]:
        """(token ids, images) of one prompt in any of generate's forms."""
        if isinstance(p, str):
            return self.tokenizer.encode(p), []
        if not isinstance(p, dict):
            return list(p), []
        unknown = set(p) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown or ("prompt" in p) == ("prompt_token_ids" in p):
            raise ValueError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids', and optionally "
                             f"'multi_modal_data'; got keys {sorted(p)}")
        ids = self.tokenizer.encode(p["prompt"]) if "prompt" in p else list(p["prompt_token_ids"])
        mm = p.get("multi_modal_data") or {}
        if set(mm) - {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' (an image or a list of them); got {sorted(mm)}")
        images = mm.get("image", [])
        return ids, list(images) if isinstance(images, (list, tuple)) else [images]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        prefill_tokens = decode_tokens = decode_steps = 0
        prefill_time = decode_time = 0.0
        spec = self.engine.spec_stats
        spec_before = spec.as_dict() if spec is not None else None
        while len(final) < len(ids):
            before = dict(self.engine.counters)
            t0 = time.perf_counter()
            outs = self.engine.step()
            dt = time.perf_counter() - t0
            p = self.engine.counters["prompt_tokens"] - before["prompt_tokens"]
            g = self.engine.counters["generation_tokens"] - before["generation_tokens"]
            # A step with prompt tokens counts as prefill time (mixed steps included), else decode.
            if p:
                prefill_tokens, prefill_time = prefill_tokens + p, prefill_time + dt
            else:
                decode_tokens, decode_time, decode_steps = decode_tokens + g, decode_time + dt, decode_steps + 1
            for o in outs:
                if o.finished and o.request_id in wanted:
                    final[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix_str(
                    f"prefill {prefill_tokens / max(prefill_time, 1e-9):.0f} tok/s, decode "
                    f"{decode_tokens / max(decode_time, 1e-9):.0f} tok/s",
                    refresh=False,
                )
        if bar is not None:
            bar.close()
        self.last_run_stats = {
            "prefill_tokens": prefill_tokens, "prefill_time_s": prefill_time,
            "decode_tokens": decode_tokens, "decode_time_s": decode_time, "decode_steps": decode_steps,
            "prefill_tokens_per_s": prefill_tokens / prefill_time if prefill_time else 0.0,
            "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        }
        if spec is not None:   # this run's share of the acceptance counters
            now = spec.as_dict()
            for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
                self.last_run_stats[k] = now[k] - spec_before[k]
            drafts, drafted = self.last_run_stats["spec_decode_num_drafts"], self.last_run_stats["spec_decode_num_draft_tokens"]
            accepted = self.last_run_stats["spec_decode_num_accepted_tokens"]
            self.last_run_stats["spec_decode_acceptance_rate"] = accepted / drafted if drafted else None
            self.last_run_stats["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
        return [final[i] for i in ids]


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:   # the GPU machine may lack tqdm: no bar then
        return None
    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
