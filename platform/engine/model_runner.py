"""Turns a scheduled batch into flat tensors, runs the model and returns the logits to sample from."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loramux.engine.scheduling.decode_groups import plan_decode_groups
from loramux.engine.scheduling.scheduler import ScheduledBatch
from loramux.engine.sequence import Sequence
from loramux.engine.speculation.medusa_heads import MedusaHeads
from loramux.model.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillChunk
from loramux.model.linear_attention import LinearStates, StateBatch
from loramux.model.llama import LlamaModel

if TYPE_CHECKING:
    from loramux.engine.cuda_graphs import DecodeGraphs, GraphBackend
    from loramux.kernels.wrapper import Location, LoRAWrapper

log = logging.getLogger(__name__)
# Why a mixture-of-experts model never runs decode steps from the fixed-shape buffers (CUDA graphs).
MOE_NO_GRAPHS = ("mixture-of-experts routing is data-dependent: each layer reads its (token, expert) counts back "
                 "to the host to size the grouped expert matmuls, which a captured graph cannot replay, and the "
                 "fixed-shape buffers' padding rows would be routed too; decode steps run eagerly")
HYBRID_NO_GRAPHS = ("a hybrid model's linear-attention layers gather and scatter per-sequence state slots that the "
                    "fixed-shape buffers do not carry; decode steps run eagerly")


@dataclass
class StepLogits:
    """The logits of one step, float32 [rows, vocab], and which rows belong to which sequence:
    `rows[i] = (seq, first row, count)`; count is 1, or 1 + len(draft) for a speculative decode (row j
    scores the token after the sequence's last token plus j drafts). `medusa[seq][j]`: the Medusa heads'
    proposals (argmax of each head) from row j of the sequence, for the sequences that wanted them."""

    logits: torch.Tensor
    rows: list[tuple[Sequence, int, int]]
    medusa: dict[Sequence, list[list[int]]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and its paged KV cache.

    Row layout of a step: every prefill chunk's tokens in order, then each speculative decode's
    [last token, drafts...], then one token per plain decode. Rows projected to logits: the last row of
    a prefill that finishes its prompt, every row of a speculative decode, every plain decode row; a
    sequence's logits rows are consecutive, in the order of the returned sequences.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, lora_wrapper: LoRAWrapper | None = None,
                 locate_adapter: Callable[[str], Location] | None = None, config=None,
                 max_model_len: int | None = None, num_state_slots: int = 0):
        """`locate_adapter(digest)`: (rank bucket, slot) of a resident adapter, for the LoRA wrapper.
        `config` (an EngineConfig): with `cuda_graphs` on a CUDA device, plain decode steps replay CUDA
        graphs (loramux.engine.cuda_graphs) for up to `max_num_seqs` sequences of up to `max_model_len`.
        `num_state_slots`: a hybrid model's per-sequence linear-attention states (one per running sequence)."""
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        # One block more than the block manager hands out: the scratch block that padding rows of a
        # fixed-shape decode step write their KV into.
        self.scratch_block = num_blocks
        self.kv = KVCache(len(cfg.attention_layers), num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                          device)
        if cfg.linear_attention is not None:
            self.kv.states = LinearStates(cfg.linear_attention, max(1, num_state_slots), dtype, device)
        # The windows of local layers in a model that also has global ones (Gemma); a model windowed on every
        # layer gives back the blocks that left the window instead (block_manager.release_out_of_window).
        self.local_windows = sorted({w for w in cfg.layer_windows if w is not None}) \
            if cfg.sliding_window is None else []
        self.lora_wrapper = lora_wrapper
        self.locate_adapter = locate_adapter
        self.medusa_of: Callable[[Sequence], MedusaHeads | None] | None = None  # set by the engine
        self.max_model_len = min(max_model_len or num_blocks * block_size, model.rope.cos.shape[0])
        self.graphs: DecodeGraphs | None = None  # DecodeGraphs when plain decode steps run from fixed-shape buffers
        self.graphs_refused: str | None = (HYBRID_NO_GRAPHS if cfg.linear_attention is not None  # why they never do
                                           else MOE_NO_GRAPHS if cfg.moe is not None else None)
        self._refusal_logged = False
        self.graph_batch = config.max_num_seqs if config is not None else 32
        if config is not None and getattr(config, "cuda_graphs", False) and self.device.type == "cuda":
            self.use_decode_graphs(capture=True)

    def use_decode_graphs(self, capture: bool, max_batch: int | None = None,
                          backend: GraphBackend | None = None) -> bool:
        """Run plain decode steps of at most `max_batch` sequences from fixed-shape buffers: replayed as CUDA
        graphs with `capture` (CUDA only), else the same path eagerly (CPU tests, bench --tiny). `backend`:
        what captures and replays (loramux.engine.cuda_graphs.CudaGraphBackend; tests pass a stand-in).
        Returns whether decode steps now take that path: never for a model `graphs_refused` names a reason for
        (a mixture-of-experts model), which keeps running every step eagerly; the reason is logged once."""
        from loramux.engine.cuda_graphs import DecodeGraphs

        if self.graphs_refused is not None:
            if not self._refusal_logged:
                log.info("decode steps run without CUDA graphs: %s", self.graphs_refused)
                self._refusal_logged = True
            self.graphs = None
            return False
        if capture and backend is None and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use capture=False to run the static path eagerly")
        self.graphs = DecodeGraphs(self, max_batch or self.graph_batch, self.max_model_len, capture, backend)
        return True

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _context(self, seq: Sequence, end: int) -> tuple[int, torch.Tensor]:
        """(keys attended, block table) of a chunk of `seq` ending at token `end`: the blocks it still holds.
        Blocks released from the sliding window (leading ones) are left out and positions count from the first
        block held: attention depends only on distances, which stay the same."""
        skip = seq.num_released_blocks
        return end - skip * self.block_size, self._tensor(seq.block_table[skip:])

    def prepare(self, batch: ScheduledBatch):
        """Build (input_ids, positions, metadata, rows to sample, sequences sampled)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sampled: list[tuple[Sequence, int, int]] = []  # (seq, first logits row, rows)
        where = self._locations([s for s, _ in batch.prefills] + batch.decodes)
        lora_rows: list[Location | None] = []  # adapter (bucket, slot) per row, None = base model
        state_chunks: list[tuple[int, int, int, bool]] = []  # hybrid models: (rows, state slot, fresh) per chunk
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            end = start + n
            all_tokens = seq.token_ids
            table = seq.block_table
            row0 = len(tokens)
            tokens.extend(all_tokens[start:end])
            positions.extend(range(start, end))
            lora_rows.extend([where[seq]] * n)
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append(PrefillChunk(row0, row0 + n, *self._context(seq, end), rope_len=seq.num_tokens))
            if seq.state_slot is not None:
                state_chunks.append((row0, row0 + n, seq.state_slot, start == 0))
            if end == seq.num_tokens:
                sampled.append((seq, len(sample_rows), 1))
                sample_rows.append(len(tokens) - 1)
        # Speculative decodes verify [last token, drafts...] as a short chunk over the cached context,
        # with logits at every position.
        plain_decodes = []
        for seq in batch.decodes:
            if not seq.draft_token_ids:
                plain_decodes.append(seq)
                continue
            start = seq.num_computed_tokens
            assert seq.state_slot is None, "speculative decoding is off for hybrid models (their state has no rollback)"
            chunk = [seq.last_token(), *seq.draft_token_ids]
            end = start + len(chunk)
            table = seq.block_table
            row0 = len(tokens)
            tokens.extend(chunk)
            positions.extend(range(start, end))
            lora_rows.extend([where[seq]] * len(chunk))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append(PrefillChunk(row0, row0 + len(chunk), *self._context(seq, end)))
            sampled.append((seq, len(sample_rows), len(chunk)))
            sample_rows.extend(range(row0, row0 + len(chunk)))
        num_prefill_tokens = len(tokens)

        decode_tables = decode_mask = decode_groups = decode_lens = None
        decode_slots: list[int] = []
        if plain_decodes:
            tables, context_lens = [], []
            # Rows of one adapter side by side: fewer, longer LoRA segments.
            for seq in sorted(plain_decodes, key=lambda s: _adapter_order(where[s])):
                if seq.state_slot is not None:
                    decode_slots.append(seq.state_slot)
                lora_rows.append(where[seq])
                p = seq.num_computed_tokens
                tokens.append(seq.last_token())
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                skip = seq.num_released_blocks
                tables.append(seq.block_table[skip:])
                context_lens.append(p + 1 - skip * bs)
                sampled.append((seq, len(sample_rows), 1))
                sample_rows.append(len(tokens) - 1)
            decode_tables, decode_mask, decode_groups = self._decode_attention_inputs(tables, context_lens)
            decode_lens = self._tensor(context_lens) if decode_groups is None else None

        meta = AttentionMetadata(self._tensor(slots), chunks, num_prefill_tokens, decode_tables, decode_mask,
                                 decode_groups, decode_lens)
        if self.kv.states is not None:
            meta.states = StateBatch.build(state_chunks, num_prefill_tokens, decode_slots, self._tensor)
        if plain_decodes and self.local_windows:
            meta.window_decodes = self._window_decodes(tables, context_lens)
        if self.lora_wrapper is not None:
            self.lora_wrapper.set_batch(lora_rows, sample_rows)
        return self._tensor(tokens), self._tensor(positions), meta, sample_rows, sampled

    def _window_decodes(self, tables: list[list[int]], context_lens: list[int]) -> dict:
        """For each window of a model's local layers (Gemma): the decode rows' tables cut to the blocks the
        window reaches, with their mask and context lengths counted from the first block kept, so a local
        layer gathers its window, not the whole context. Windows every row still fits are left out."""
        bs, cuts = self.block_size, {}
        for window in self.local_windows:
            firsts = [max(0, n - window) // bs for n in context_lens]
            if not any(firsts):
                continue
            lens = [n - f * bs for n, f in zip(context_lens, firsts)]
            padded, mask = self._padded_tables_and_mask([t[f:] for t, f in zip(tables, firsts)], lens)
            cuts[window] = (padded, mask, self._tensor(lens))
        return cuts

    def _decode_attention_inputs(self, tables: list[list[int]], context_lens: list[int]):
        """(tables, mask, None) for one attention call over every decode row, or (None, None, groups) when rows
        of very different context lengths attend in groups (loramux.engine.scheduling.decode_groups)."""
        groups = plan_decode_groups([len(t) for t in tables])
        if len(groups) == 1:
            return (*self._padded_tables_and_mask(tables, context_lens), None)
        return None, None, [DecodeGroup(self._tensor(rows), *self._padded_tables_and_mask(
            [tables[i] for i in rows], [context_lens[i] for i in rows]),
            self._tensor([context_lens[i] for i in rows])) for rows in groups]

    def _padded_tables_and_mask(self, tables: list[list[int]], context_lens: list[int]):
        bs = self.block_size
        max_blocks = max(len(t) for t in tables)
        padded = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        lens = self._tensor(context_lens)
        valid = torch.arange(max_blocks * bs, device=self.device)[None, :] < lens[:, None]
        # Additive float mask built once per step (a bool mask is converted again in every layer).
        mask = torch.zeros(valid.shape, dtype=self.kv.k.dtype, device=self.device)
        return padded, mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]

    def _locations(self, seqs: list[Sequence]) -> dict[Sequence, Location | None]:
        locate = self.locate_adapter
        if locate is None:  # no adapters served: every row is the base model's
            assert all(seq.adapter is None for seq in seqs), "a sequence has an adapter but nothing locates it"
            return dict.fromkeys(seqs)
        return {seq: locate(seq.adapter) if seq.adapter is not None else None for seq in seqs}

    def _run_graphed(self, batch: ScheduledBatch) -> StepLogits | None:
        """A plain decode step from the fixed-shape buffers (see loramux.engine.cuda_graphs), or None when
        it fits no graph shape."""
        where = self._locations(batch.decodes)
        if any(loc is not None and getattr(loc[0], "extras", ()) for loc in where.values()):
            return None  # trained embeddings / heads run eagerly (their rows change the embedding and logits)
        if self.lora_wrapper is not None:
            self.lora_wrapper.set_batch(None)  # no per-row state of an earlier eager step in the graphed one
        seqs = sorted(batch.decodes, key=lambda s: _adapter_order(where[s]))
        assert self.graphs is not None  # run() calls this only with graphs
        logits = self.graphs.run(seqs, [where[s] for s in seqs])
        return None if logits is None else StepLogits(logits, [(seq, i, 1) for i, seq in enumerate(seqs)])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        """Forward the batch; the logits of every sequence that has a token to sample."""
        if self.graphs is not None and self.graphs.accepts(batch) and not any(s.medusa_wanted for s in batch.decodes):
            step = self._run_graphed(batch)
            if step is not None:
                return step
        input_ids, positions, meta, sample_rows, sampled = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv, meta)
        if not sampled:
            return StepLogits(torch.empty(0), sampled)
        rows = hidden[self._tensor(sample_rows)] if len(sample_rows) != hidden.shape[0] else hidden
        heads = [(seq, row, n, self.medusa_of(seq)) for seq, row, n in sampled if seq.medusa_wanted] \
            if self.medusa_of is not None else []
        heads = [h for h in heads if h[3] is not None]
        if not heads:
            return StepLogits(self.model.compute_logits(rows).float(), sampled)
        return self._with_medusa(rows, sampled, heads)

    def _with_medusa(self, rows: torch.Tensor, sampled, heads) -> StepLogits:
        """The step's logits and the Medusa proposals of the sequences in `heads` ((seq, row, count, heads)):
        each head's residual block over each of the sequence's rows, projected by the LM head in the same call
        as the step's logits rows (one pass over the head's weights), unless adapters' trained heads replace
        the logits (then the base LM head projects the Medusa rows on its own)."""
        extra = torch.cat([h.residuals(rows[row:row + n]).reshape(-1, rows.shape[1]).to(rows.dtype)
                           for _, row, n, h in heads])
        wrapper = self.model.lora_wrapper
        if wrapper is not None and wrapper.replaces_logits:
            logits = self.model.compute_logits(rows).float()
            extra_tokens = self.model.lm_head(extra).argmax(dim=-1)
        else:
            both = self.model.compute_logits(torch.cat([rows, extra]))
            logits, extra_tokens = both[:rows.shape[0]].float(), both[rows.shape[0]:].argmax(dim=-1)
        flat, medusa, at = extra_tokens.tolist(), {}, 0
        for seq, _, n, h in heads:
            k = h.num_heads
            medusa[seq] = [flat[at + j * k: at + (j + 1) * k] for j in range(n)]
            at += n * k
        return StepLogits(logits, sampled, medusa)


def _adapter_order(location) -> tuple:
    """Sort key of a decode row: base-model rows first, then by (bucket, slot): one adapter's rows side by side
    (fewer, longer LoRA segments)."""
    return (0,) if location is None else (1, *location)
