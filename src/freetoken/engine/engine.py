"""The offline batch engine: add requests, step until done.

One step = schedule -> (prefill chunks | propose drafts, verify k+1 rows per request, accept,
commit) -> hand the committed rows to the spec method. Shaped after nano-vllm's LLMEngine, with the
decode step written as gpt-fast's speculative loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from freetoken import sampling
from freetoken.engine.config import EngineConfig
from freetoken.engine.cuda_graph import DecodeGraphs
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.request import Request
from freetoken.engine.runner import RowGroup, build_context
from freetoken.engine.scheduler import PrefillChunk, Scheduler
from freetoken.engine.spec_protocol import CommittedRows, SpecMethod
from freetoken.forward_context import ForwardMode
from freetoken.layers.merge import merge_projections
from freetoken.sampling import SamplingParams
from freetoken.spec import spec_method_class


@dataclass
class StepStats:
    prefill_tokens: int = 0
    decode_steps: int = 0  # target decode/verify forwards
    generated_tokens: int = 0
    num_preemptions: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # index i: verifies that accepted draft i+1
    num_verifies: int = 0  # request-level verify rows groups (one per request per decode step)


def kv_blocks_for_memory(free_bytes: int, mem_fraction: float, block_bytes: int, device: str) -> int:
    """KV blocks that fit in mem_fraction of free_bytes (every layer's keys and values of one block)."""
    from freetoken.errors import FreetokenError

    blocks = int(free_bytes * mem_fraction) // block_bytes
    if blocks < 1:
        raise FreetokenError(f"--mem-fraction {mem_fraction} of the {free_bytes / 2**30:.1f} GiB free on {device} holds no KV block")
    return blocks


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, origin: str | None = None):
        self.model, self.config = merge_projections(model), config
        self.device = torch.device(config.device)
        k = config.num_draft_tokens
        num_kv_heads, head_dim = model.kv_head_shape
        num_linear, conv_shape, recurrent_shape = model.linear_state_shapes
        use_graphs = config.cuda_graphs and config.tensor_parallel == 1 and DecodeGraphs.supported(model, self.device)
        spare = int(use_graphs)  # the graphs' padding rows get a KV block and a state slot of their own
        self.state_pool = LinearStatePool(num_linear, config.max_num_seqs + spare, conv_shape, recurrent_shape, config.torch_dtype, self.device) if num_linear else None
        block_bytes = model.num_kv_layers * config.block_size * num_kv_heads * head_dim * 2 * config.torch_dtype.itemsize
        self.kv_pool = KVPool(model.num_kv_layers, self._num_kv_blocks(block_bytes) + spare, config.block_size, num_kv_heads, head_dim, config.torch_dtype, self.device)
        max_blocks_per_seq = -(-(config.max_model_len + k + 1) // config.block_size)
        self.spec: SpecMethod = spec_method_class(config.spec)(model, self.kv_pool, k, self.device, origin=origin,
                                                               cuda_graphs=config.cuda_graphs, max_blocks_per_seq=max_blocks_per_seq)
        self.graphs = DecodeGraphs(model, self.kv_pool, self.state_pool, self.device, max_blocks_per_seq, config.max_num_seqs) if use_graphs else None
        self.scheduler = Scheduler(self.kv_pool, self.state_pool, config.max_num_seqs, config.max_num_batched_tokens, k, config.prefill_align)
        self.eos_ids = set(model.eos_token_ids)
        self.stats = StepStats(accepted_per_position=[0] * k)
        self._next_id = 0

    def _num_kv_blocks(self, block_bytes: int) -> int:
        """--num-kv-blocks if given; else a share of free GPU memory (--mem-fraction); else room for
        max_num_seqs requests of max_model_len tokens."""
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        if config.mem_fraction and self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)  # the state pool is already allocated
            return kv_blocks_for_memory(free_bytes, config.mem_fraction, block_bytes, self.config.device)
        return config.max_num_seqs * -(-(config.max_model_len + config.num_draft_tokens + 1) // config.block_size)

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        if not prompt_token_ids:
            from freetoken.errors import FreetokenError

            raise FreetokenError("empty prompt")
        request = Request(self._next_id, list(prompt_token_ids), params)
        request.generator = sampling.make_generator(params, self._next_id, self.device, self.config.seed)
        self._next_id += 1
        self.scheduler.add(request)
        return request

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], on_step: Callable[[list[Request]], None] | None = None) -> list[Request]:
        """Run every prompt to completion; returns the requests in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        while self.scheduler.has_work:
            finished = self.step()
            if on_step is not None:
                on_step(finished)
        return requests

    # -- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Advance the engine by one forward; returns the requests that finished in it."""
        scheduled = self.scheduler.schedule()
        for request in scheduled.preempted:
            self.spec.release(request)
        self.stats.num_preemptions += len(scheduled.preempted)
        if scheduled.prefill:
            self._prefill(scheduled.prefill)
            return []
        if scheduled.decode:
            return self._decode(scheduled.decode)
        return []

    def _prefill(self, chunks: list[PrefillChunk]) -> None:
        align = self.scheduler.prefill_align
        groups = [RowGroup(c.request.block_table, c.request.state_slot, c.start, c.request.token_ids[c.start : c.start + c.length],
                           chunkable_end=len(c.request.prompt_token_ids) // align * align) for c in chunks]
        ctx = build_context(groups, ForwardMode.EXTEND, self.kv_pool, self.state_pool, self.device)
        hidden = self.model(ctx)
        committed = []
        for chunk, seq in zip(chunks, ctx.seqs):
            request = chunk.request
            request.num_cached_tokens += chunk.length
            tokens = request.token_ids
            committed.append(CommittedRows(request, chunk.start, hidden[seq.rows], tokens[chunk.start + 1 : chunk.start + chunk.length + 1]))
            self.stats.prefill_tokens += chunk.length
        self.spec.observe(committed)

    def _verify(self, requests: list[Request], groups: list[RowGroup], proposal) -> tuple[torch.Tensor, list[int], list[int]]:
        """Target forward over every request's k+1 rows, verify, commit -> (hidden [B*(k+1), H], accepted drafts, next tokens)."""
        k = self.spec.num_draft_tokens
        mode = ForwardMode.VERIFY if k > 0 else ForwardMode.EXTEND
        greedy = all(r.params.is_plain_greedy for r in requests)
        if self.graphs is not None:
            step = self.graphs.run(groups, mode, greedy)  # outputs of padding rows follow the requests' rows
            rows = len(requests) * (k + 1)
            if greedy:  # verify and commit ran inside the graph
                accepted, next_tokens = step.result[:, : len(requests)].tolist()
                return step.hidden[:rows], accepted, next_tokens
            result = self._sample(step.logits[:rows], requests, proposal)
            if k > 0:
                self.graphs.commit(step, result.accepted_len + 1)  # on the device: no host round trip first
            return step.hidden[:rows], result.accepted_len.tolist(), result.next_token.tolist()
        ctx = build_context(groups, mode, self.kv_pool, self.state_pool, self.device)
        hidden = self.model(ctx)
        result = self._sample(self.model.compute_logits(hidden), requests, proposal)
        accepted = result.accepted_len.tolist()
        if k > 0:
            self.model.commit(ctx, [a + 1 for a in accepted])
        return hidden, accepted, result.next_token.tolist()

    def _sample(self, logits: torch.Tensor, requests: list[Request], proposal) -> sampling.VerifyResult:
        """Chain verification of the drafts against the target logits [B*(k+1), V]."""
        return sampling.verify(
            logits.view(len(requests), self.spec.num_draft_tokens + 1, -1),
            proposal.tokens.to(self.device),
            proposal.probs,
            [r.params for r in requests],
            [r.output_token_ids for r in requests],
            [r.generator for r in requests],
        )

    def _finish_reason(self, request: Request, kept: list[int], done: bool) -> str:
        """"stop" for an EOS or stop token, "length" for max_new_tokens or the model length."""
        last = kept[-1] if kept else None
        stopped = last in request.params.stop_token_ids or (last in self.eos_ids and not request.params.ignore_eos)
        return "stop" if done and stopped else "length"

    def _decode(self, requests: list[Request]) -> list[Request]:
        k = self.spec.num_draft_tokens
        proposal = self.spec.propose(requests)
        drafts = proposal.tokens.tolist()
        groups = [RowGroup(r.block_table, r.state_slot, r.num_cached_tokens, [r.last_token_id] + d) for r, d in zip(requests, drafts)]
        hidden, accepted, next_tokens = self._verify(requests, groups, proposal)
        row_slices = [slice(i * (k + 1), (i + 1) * (k + 1)) for i in range(len(requests))]
        self.stats.decode_steps += 1

        finished: list[Request] = []
        committed: list[CommittedRows] = []
        for request, rows, draft, a, nxt in zip(requests, row_slices, drafts, accepted, next_tokens):
            start = request.num_cached_tokens
            emitted = draft[:a] + [nxt]
            kept, done = sampling.apply_stop(emitted, request.params, self.eos_ids, len(request.output_token_ids))
            request.output_token_ids += kept
            request.num_cached_tokens += a + 1
            request.num_target_steps += 1
            if k > 0:
                request.accepted_lens.append(a)
                self.stats.num_verifies += 1
                for i in range(a):
                    self.stats.accepted_per_position[i] += 1
            self.stats.generated_tokens += len(kept)
            if done or request.num_tokens >= self.config.max_model_len:
                self.scheduler.finish(request, self._finish_reason(request, kept, done))
                self.spec.release(request)
                finished.append(request)
            else:
                self.kv_pool.trim(request.block_table, request.num_cached_tokens)
                committed.append(CommittedRows(request, start, hidden[rows][: a + 1], emitted))
        self.spec.observe(committed)
        return finished
