"""A step's results made into the requests' progress and outputs: tokens appended, every stop
rule checked at every token (EOS and the config's other end tokens, stop token ids and strings,
the grammar's end, min_tokens, max_tokens, max_model_len), text made where it is needed, and one
RequestOutput per request the step advanced (LLMEngine schedules; this reads what a step made)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kdaserve.engine.outputs import ListPrefix, RequestOutput
from kdaserve.engine.sequence import Sequence

logger = logging.getLogger("kdaserve.engine")


class OutputProcessor:
    def __init__(self, *, eos_token_ids: list[int | None], max_model_len: int, num_spec_tokens: int, counters: dict,
                 finish: Callable[[Sequence, str], None], proposer=None, spec_stats=None):
        """`eos_token_ids`: the tokenizer's end token, then the config's (GLM lists several: endoftext,
        <|user|>, <|observation|>); any of them ends a request. `finish(seq, reason)`: the engine
        ends a request (its slot and blocks back, its drafts forgotten). `counters`: the engine's,
        whose generation_tokens this counts."""
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.more_eos_token_ids = frozenset(t for t in eos_token_ids[1:] if t is not None)
        self.stop_ids = frozenset(t for t in eos_token_ids if t is not None)
        self.max_model_len, self.num_spec_tokens = max_model_len, num_spec_tokens
        self.counters, self.finish, self.proposer, self.spec_stats = counters, finish, proposer, spec_stats
        # Text of every output as it streams. Offline generation (LLM) turns it off: text is then
        # decoded when a request finishes (or as needed for stop strings), saving host time per token.
        self.incremental_text = True
        # Whether this engine makes every output's text. The server's engine process turns it off:
        # then only requests with stop strings get text here (they need it to end), the others'
        # outputs carry text None and the API processes detokenize them (engine/output_wire.py),
        # as vLLM's front end does: detokenizing is a quarter of a decode step's host work, and
        # the engine process is the one serial part of the serving path, the API processes many.
        self.detokenize = True

    def process(self, batch, result, outputs: list) -> None:
        """Read `batch`'s results (waiting for its tokens), append them and report the requests
        it advanced. Requests that ended while it ran (aborted, or stopped by the step before,
        with async scheduling) drop their token."""
        for seq, index, entry in result.prompt_logprobs:
            if index == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(entry)
        touched = {s.seq_id: s for s, _, _ in result.prompt_logprobs}
        sampled = result.sampled
        tokens, logprobs = sampled.token_ids, sampled.logprobs
        now = time.monotonic()
        for seq, token, logprob in zip(result.sample_seqs, tokens, logprobs):   # empty after a verify
            if seq.is_finished:
                continue
            self._append_token(seq, token, logprob, now)
            touched[seq.seq_id] = seq
        if result.accepted is not None:
            self._apply_verified(batch, result.accepted, now, touched)
        for seq, drafts in result.drafts:   # MTP: for the next verify, if the request goes on
            if not seq.is_finished:
                self.proposer.set_drafts(seq, drafts)
        for seq in touched.values():
            new = seq.new_token_ids
            if new and seq.streamed and len(new) < seq.stream_interval and not seq.is_finished:
                continue   # --stream-interval: these tokens go out with a later output
            outputs.append(self.output(seq, new))
            seq.new_token_ids = []
            seq.streamed = seq.streamed or bool(new)

    def _apply_verified(self, batch, accepted, now: float, touched: dict) -> None:
        """A verify's outputs: the cache now holds its first token and the accepted drafts (the
        next step resumes from the state after the last of them); every accepted token and the
        first rejecting row's token are appended, until the request finishes."""
        verifying = {s.seq_id for s in batch.decodes}
        for a in accepted:
            seq = a.seq
            if seq.seq_id in verifying:
                seq.num_computed_tokens += a.num_accepted_drafts
                seq.num_accepted = 1 + a.num_accepted_drafts
                self.spec_stats.observe(a.num_drafts, a.num_accepted_drafts)
                if a.num_drafts:
                    if seq.spec_histogram is None:
                        seq.spec_histogram = [0] * (self.num_spec_tokens + 1)
                    seq.spec_histogram[a.num_accepted_drafts] += 1
                    seq.num_draft_tokens += a.num_drafts
            seq.draft_token_ids = []
            last = len(a.tokens) - 1
            for k, token in enumerate(a.tokens):
                self._append_token(seq, token, a.logprobs[k] if a.logprobs is not None else None, now, more_follow=k < last)
                if seq.is_finished:
                    break
            touched[seq.seq_id] = seq

    def _append_token(self, seq: Sequence, token: int, logprob, now: float, more_follow: bool = False) -> None:
        """`more_follow`: more tokens of this step come next (a verify's), so streaming text waits
        for the last of them (one decode of the new tokens, not one per token); stop strings and
        the end of the request are still checked at every token."""
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        self.counters["generation_tokens"] += 1
        seq.metrics.setdefault("first_token_time", now)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append({"token_id": token, "logprob": logprob[0], "top": logprob[1]})
        p = seq.params
        # Lengths read once (this runs per token of every running request: the engine's host time).
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        # Before min_tokens outputs nothing but the length limits ends a request (vLLM's rule).
        may_stop = num_output >= p.min_tokens
        is_eos = token == self.eos_token_id or token in self.more_eos_token_ids
        stop_token = may_stop and (token in p.stop_token_ids or (not p.ignore_eos and is_eos))
        if seq.grammar is not None:
            # The grammar is complete once it accepts one of its stop tokens (the model's end tokens).
            if not seq.grammar.accept_token(token):
                logger.warning("request %s: token %d is outside its grammar; the request ends here", seq.request_id, token)
                stop_token = True
            elif seq.grammar.is_terminated():
                stop_token = True
        reason = "stop" if stop_token else None
        done = stop_token or num_output >= p.max_tokens or num_tokens >= self.max_model_len
        needs_text = bool(p.stop) or (self.detokenize and (done or (self.incremental_text and not more_follow)))
        # The outputs' text leaves a stop token out; bounds into token_ids, no copy of the outputs.
        text_end = num_tokens - 1 if stop_token else num_tokens
        if needs_text and seq.detokenizer.add(seq.token_ids, final=done, start=seq.num_prompt_tokens, end=text_end,
                                              check_stop=may_stop) is not None:
            reason = "stop"
        elif reason is None and done:
            reason = "length"
        if reason is not None:
            seq.metrics["finish_time"] = now
            self.finish(seq, reason)

    def output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        """`new_ids` becomes the output's own list (callers hand over a list they drop). The lists
        of everything so far are ListPrefix snapshots: O(1) per step, copied only when read."""
        # Positional: once per request and step, and keywords cost a third more for twelve fields.
        logprobs, prompt_logprobs, num_prompt = seq.logprobs, seq.prompt_logprobs, seq.num_prompt_tokens
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            ListPrefix(seq.token_ids, num_prompt),
            new_ids,
            seq.detokenizer.text if self.detokenize or seq.params.stop else None,
            seq.is_finished,
            seq.finish_reason,
            ListPrefix(logprobs) if logprobs is not None else None,
            ListPrefix(prompt_logprobs) if prompt_logprobs is not None else None,
            num_prompt,
            len(seq.token_ids) - num_prompt,
            self._metrics(seq),
        )

    def _metrics(self, seq: Sequence) -> dict:
        """Times (time.monotonic) and counts of a request; a finished one that went through verify
        steps also gets its speculative acceptance (vLLM's per-request speculative metrics).

        One dict for every output until something in it changes (times are only ever added, so
        their count tells): outputs must not modify it. The output wire sends it only when it is
        a new one (engine/output_wire.py)."""
        key = (len(seq.metrics), seq.num_preemptions, seq.num_cached_tokens, seq.is_finished)
        made = seq.metrics_out
        if made is not None and made[0] == key:
            return made[1]
        out = dict(seq.metrics, num_preemptions=seq.num_preemptions, num_cached_tokens=seq.num_cached_tokens)
        h = seq.spec_histogram
        if seq.is_finished and h is not None:
            accepted = sum(j * n for j, n in enumerate(h))
            out["spec_decode"] = {
                "mean_acceptance_length": 1 + accepted / sum(h),
                "draft_acceptance_rate": accepted / seq.num_draft_tokens,
                "acceptance_histogram": list(h),
                "num_spec_steps": sum(h),
                "num_accepted_draft_tokens": accepted,
                "num_draft_tokens": seq.num_draft_tokens,
                "num_spec_tokens": self.num_spec_tokens,
            }
        seq.metrics_out = (key, out)
        return out
