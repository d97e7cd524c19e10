"""CUDA graphs for decode steps: one graph per batch size bucket, captured over static input and
metadata buffers. A decode batch of n sequences replays the smallest bucket >= n; the padding
rows point at the null state slot (KDA layers skip them), the null KV block (reads) and the trash
KV row (writes), so they change nothing that a real sequence will ever read.

With speculative decoding every decode is a verify of m = S+1 tokens per sequence: the graphs are
captured for verify steps instead (m token rows per sequence, the per-token state slots and the
accepted counts among the static buffers), at the same batch sizes."""

from __future__ import annotations

import numpy as np
import torch

from kdaserve.backends.kda_backends import KDABackends
from kdaserve.engine.staging import PackedLayout, StagingRing
from kdaserve.engine.step_context import build_context
from kdaserve.engine.step_inputs import HostStep, gather_inputs, write_block_tables
from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.context import Context, reset_context, set_context


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class DecodeStaticInputs:
    """The graphs' static input and metadata buffers for up to `max_batch_size` rows: views of one
    device buffer, filled each step from a pinned staging buffer by one non-blocking copy of its
    first bytes (staging.py says why, and how reuse of the pinned buffer stays safe).

    The block tables are max_model_len / block_size wide (65536 columns at a 1M context), but a
    step stages only the columns its longest table uses, packed, and one device copy puts them
    into the static table: columns past a row's own blocks keep older values, which the attention
    kernels never read (they stop at the row's context length), and which are block ids, never
    out of range."""

    def __init__(self, max_batch_size: int, block_table_width: int, trash_row: int, device, tokens_per_seq: int = 1):
        B, self.width, self.trash_row, m = max_batch_size, block_table_width, trash_row, tokens_per_seq
        self.m = m
        i64, i32 = torch.int64, torch.int32
        # Block tables last: a step copies the layout up to its own batch's rows of them.
        self.layout = PackedLayout([
            ("input_ids", i64, (B * m,)), ("positions", i64, (B * m,)), ("slot_mapping", i64, (B * m,)),
            ("sample_rows", i64, (B * m,)), ("decode_state_indices", i32, (B,)), ("decode_context_lens", i32, (B * m,)),
            ("spec_state_indices", i32, (B, m) if m > 1 else (0,)), ("num_accepted_tokens", i32, (B if m > 1 else 0,)),
            ("decode_block_tables", i32, (B * m, block_table_width)),
        ])
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        # The graphs' inputs by HostStep's names; the staged block tables are a step's [rows, used
        # columns], packed, and one device copy spreads them into the full-width static table.
        self.views = self.layout.device_views(self.buffer)
        self._packed_tables = self.views["decode_block_tables"].view(-1)
        self.views["decode_block_tables"] = torch.zeros((B * m, block_table_width), dtype=i32, device=device)
        self.input_ids, self.positions = self.views["input_ids"], self.views["positions"]
        self.sample_rows = self.views["sample_rows"]   # read outside the graph (logit rows), staged with the rest
        self.views["slot_mapping"].fill_(trash_row)
        self.views["decode_context_lens"].fill_(1)
        self.views["num_accepted_tokens"].fill_(1)
        self.ring = StagingRing(self.layout.nbytes, torch.device(device))
        self._host_views: dict[int, tuple[object, dict]] = {}   # per ring buffer: its numpy views, made once

    def stage(self, step: HostStep, bs: int) -> torch.Tensor | None:
        """Write the step, padded to `bs` rows, into a pinned buffer and copy that into the static
        buffers. Returns the device index of the sample rows (None: they are rows 0..k-1)."""
        n, m = step.num_decodes, self.m
        i, host = self.ring.acquire(self.layout.nbytes)
        cached = self._host_views.get(i)
        if cached is None or cached[0] is not host:
            cached = self._host_views[i] = (host, self.layout.host_views(host))
        h = cached[1]
        for name, pad, rows in (("input_ids", 0, m), ("positions", 0, m), ("slot_mapping", self.trash_row, m),
                                ("decode_state_indices", 0, 1), ("decode_context_lens", 1, m)):
            h[name][: n * rows] = getattr(step, name)
            h[name][n * rows : bs * rows] = pad
        if m > 1:
            h["spec_state_indices"][:n] = step.spec_state_indices
            h["spec_state_indices"][n:bs] = 0
            h["num_accepted_tokens"][:n] = step.num_accepted_tokens
            h["num_accepted_tokens"][n:bs] = 1
        tables = step.decode_tables
        used = max(1, tables.shape[1] if isinstance(tables, np.ndarray) else max((t.shape[0] for t in tables), default=1))
        packed = h["decode_block_tables"].reshape(-1)[: bs * m * used].reshape(bs * m, used)
        write_block_tables(packed, tables)   # padding rows: null blocks only
        rows = step.logits.sample_rows
        staged_rows = not step.logits.sample_rows_are_leading
        if staged_rows:
            h["sample_rows"][: len(rows)] = rows
        offset = self.layout.fields["decode_block_tables"][0]
        self.ring.submit(i, self.buffer, offset + bs * m * used * 4)
        self.views["decode_block_tables"][: bs * m, :used].copy_(self._packed_tables[: bs * m * used].view(bs * m, used))
        return self.sample_rows[: len(rows)] if staged_rows else None


class DecodeGraphs:
    def __init__(self, model, kda_backends: KDABackends | None, *, max_batch_size: int, block_table_width: int,
                 trash_row: int, hidden_size: int, dtype, device, tokens_per_seq: int = 1):
        self.model, self.kda_backends = model, kda_backends
        self.sizes = graph_batch_sizes(max_batch_size)
        self.width, self.m = block_table_width, tokens_per_seq
        self.inputs = DecodeStaticInputs(self.sizes[-1], block_table_width, trash_row, device, tokens_per_seq)
        self.outputs = torch.zeros(self.sizes[-1] * tokens_per_seq, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _context(self, bs: int) -> Context:
        """What the graph of batch size `bs` is captured under: the first `bs` sequences of the
        static buffers (their values change at every replay, their addresses never)."""
        return build_context(self.inputs.views, self.kda_backends, num_decodes=bs, tokens_per_decode=self.m,
                             for_capture=True)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        ids, pos = self.inputs.input_ids, self.inputs.positions
        # Largest first, so smaller graphs fit in the memory pool the largest one reserved.
        for bs in reversed(self.sizes):
            set_context(self._context(bs))
            rows = bs * self.m
            # Warm-up outside capture (kernel compilation, autotuning); all rows are padding here.
            self.outputs[:rows] = self.model(ids[:rows], pos[:rows])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[:rows] = self.model(ids[:rows], pos[:rows])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        reset_context()

    def can_run(self, step: HostStep) -> bool:
        return (
            0 < step.num_decodes <= self.sizes[-1]
            and step.tokens_per_decode == self.m
            and not step.prefill_query_lens
            and step.decode_width <= self.width
        )

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def attention_context(self, step: HostStep) -> tuple[Context, torch.Tensor]:
        """(attention context, positions) of the real rows of the step just replayed, as views of
        the static buffers: what a pass after the graph (the MTP drafter's) runs under. Valid until
        the next step stages its inputs (stream order keeps the pass before that copy)."""
        rows = step.num_decode_tokens
        return Context(attn=AttentionMetadata.build(self.inputs.views, rows)), self.inputs.positions[:rows]

    def run(self, step: HostStep, input_source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the decode step; returns the hidden states of its real rows and the device
        index of its sample rows (None: rows 0..k-1). `input_source`: the step's input ids were
        staged as rows of this device tensor (async scheduling), gathered before the replay."""
        bs = self.bucket(step.num_decodes)
        sample_rows = self.inputs.stage(step, bs)
        if input_source is not None:
            gather_inputs(self.inputs.input_ids[: step.num_decodes], input_source)
        self.graphs[bs].replay()
        return self.outputs[: step.num_decode_tokens], sample_rows
