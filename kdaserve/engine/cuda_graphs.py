"""CUDA graphs for decode steps: one graph per batch size bucket, captured over static input and
metadata buffers. A decode batch of n sequences replays the smallest bucket >= n; the padding
rows point at the null state slot (KDA layers skip them), the null KV block (reads) and the trash
KV row (writes), so they change nothing that a real sequence will ever read."""

from __future__ import annotations

import numpy as np
import torch

from kdaserve.engine.step_inputs import HostStep
from kdaserve.layers.attention import AttentionMetadata
from kdaserve.layers.context import Context, KDAStepMetadata, reset_context, set_context


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphs:
    def __init__(self, model, *, max_batch_size: int, block_table_width: int, trash_row: int, hidden_size: int, dtype, device):
        self.model = model
        self.sizes = graph_batch_sizes(max_batch_size)
        self.width = block_table_width
        self.trash_row = trash_row
        B = self.sizes[-1]
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)
        self.state_indices = torch.zeros(B, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((B,), trash_row, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(B, block_table_width, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.outputs = torch.zeros(B, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _context(self, bs: int) -> Context:
        kda = KDAStepMetadata(num_decodes=bs, num_decode_tokens=bs, decode_state_indices=self.state_indices[:bs])
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs], decode_context_lens=self.context_lens[:bs],
        )
        return Context(kda=kda, attn=attn)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first, so smaller graphs fit in the memory pool the largest one reserved.
        for bs in reversed(self.sizes):
            set_context(self._context(bs))
            # Warm-up outside capture (kernel compilation, autotuning); all rows are padding here.
            self.outputs[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        reset_context()

    def can_run(self, step: HostStep) -> bool:
        return (
            0 < step.num_decodes <= self.sizes[-1]
            and not step.prefill_lens
            and step.decode_block_tables.shape[1] <= self.width
        )

    def run(self, step: HostStep) -> torch.Tensor:
        """Replay the decode step; returns the hidden states of its real rows."""
        n = step.num_decodes
        bs = next(b for b in self.sizes if b >= n)

        def fill(buf: torch.Tensor, values: np.ndarray, pad_value) -> None:
            host = np.empty((bs, *buf.shape[1:]), dtype=values.dtype)
            host[:n] = values
            host[n:] = pad_value
            buf[:bs].copy_(torch.from_numpy(host), non_blocking=False)

        fill(self.input_ids, step.input_ids, 0)
        fill(self.positions, step.positions, 0)
        fill(self.state_indices, step.decode_slots, 0)
        fill(self.slot_mapping, step.slot_mapping, self.trash_row)
        fill(self.context_lens, step.decode_context_lens, 1)
        tables = np.zeros((n, self.width), dtype=np.int32)
        tables[:, : step.decode_block_tables.shape[1]] = step.decode_block_tables
        fill(self.block_tables, tables, 0)
        self.graphs[bs].replay()
        return self.outputs[:n]
