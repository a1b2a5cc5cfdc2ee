"""The offline batch engine: add requests, step until done.

One step = schedule -> (prefill chunks | propose drafts, verify k+1 rows per request, accept,
commit) -> hand the committed rows to the spec method. Shaped after nano-vllm's LLMEngine, with the
decode step written as gpt-fast's speculative loop.

Overlap (EngineConfig.overlap). A decode step without drafts whose requests are all greedy without
penalties is launched without waiting for its tokens (`_launch`): each request gets a PENDING output
token, its new row counts as cached, and the step's next tokens are copied to the host
asynchronously. The next step() first launches the decode step after it if that step is known
without those tokens (`_follow_up`: the same running requests less those that end by length, nobody
admitted, no preemption), its input tokens taken on the device from the step in flight; only then
does it read the step in flight back (`_resolve`): its tokens replace the PENDING ones, and stop
tokens and length limits end requests exactly as `_decode` does. The GPU thus runs step n+1 while
the host does step n's bookkeeping. The forward and the greedy pick are `_decode`'s, so the tokens
are the same bits. A request that stops at step n on a stop token has a row in step n+1: that row's
token is never read, its PENDING token is dropped, and its KV row and GDN state writes land in the
blocks and the slot it frees, which later users overwrite on the same stream after step n+1. When
the next step is not known that way (a request waits for a seat, the pool is short, a prefill, a
sampled request, drafts), the step in flight is read back first and the next one is scheduled as
usual, so scheduler.schedule() never sees a PENDING token. Requests are returned as finished by the
step() call after the one that launched their last step. StepStats.decode_steps counts every
launched step, including one whose rows all belong to requests that stopped just before it;
generated_tokens counts the tokens in the outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from freetoken import sampling
from freetoken.engine.config import EngineConfig
from freetoken.engine.cuda_graph import DecodeGraphs
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.linear_state_pool import LinearStatePool
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.request import Request, RequestStatus
from freetoken.engine.request_images import RequestImages
from freetoken.engine.runner import RowGroup, build_context, run_target
from freetoken.engine.scheduler import PrefillChunk, Scheduler
from freetoken.engine.spec_protocol import CommittedRows, SpecMethod
from freetoken.forward_context import ForwardMode
from freetoken.layers.merge import merge_projections
from freetoken.sampling import SamplingParams
from freetoken.spec import spec_method_class


PENDING = -1  # the output token of a launched step until its tokens are read back


@dataclass
class StepStats:
    prefill_tokens: int = 0
    decode_steps: int = 0  # target decode/verify forwards launched (with overlap, also those whose rows all turned out finished)
    overlapped_steps: int = 0  # decode steps launched before the previous step's tokens were read back
    generated_tokens: int = 0  # tokens in the requests' outputs
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


@dataclass
class InFlightStep:
    """A launched greedy k = 0 decode step whose tokens have not been read back yet."""

    requests: list[Request]  # batch order
    output_index: list[int]  # where each request's PENDING token sits in its output_token_ids
    next_tokens: torch.Tensor  # [B] int64 on the device; the eager path feeds the next step from it
    host_tokens: torch.Tensor  # [B] int64 on the host, filled by an asynchronous copy
    copied: torch.cuda.Event | None  # recorded behind that copy (None: host_tokens is already filled)
    by_graph: bool = False  # replayed as a CUDA graph (its next tokens are also in DecodeGraphs.last_tokens)

    def tokens(self) -> list[int]:
        """The step's next tokens (waits for its copy, not for steps launched after it)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_tokens.tolist()


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, origin: str | None = None, vision_tower: torch.nn.Module | None = None):
        """vision_tower: encodes the images of requests that carry them (models/vision); None: no image prompts."""
        self.model, self.config = merge_projections(model), config
        self.vision_tower = vision_tower
        self.device = torch.device(config.device)
        k = config.num_draft_tokens
        num_kv_heads, head_dim = model.kv_head_shape
        num_linear, conv_shape, recurrent_shape = model.linear_state_shapes
        use_graphs = config.cuda_graphs and config.tensor_parallel == 1 and DecodeGraphs.supported(model, self.device)
        spare = int(use_graphs)  # the graphs' padding rows get a KV block and a state slot of their own
        # optional per-request states and per-token KV rows a model declares beyond GDN state and K/V
        extra_states, extra_kv = getattr(model, "extra_state_specs", ()), getattr(model, "extra_kv_shapes", ())
        self.state_pool = LinearStatePool(num_linear, config.max_num_seqs + spare, conv_shape, recurrent_shape, config.torch_dtype, self.device,
                                          extra_states) if num_linear or extra_states else None
        token_elems = model.num_kv_layers * num_kv_heads * head_dim * 2 + sum(math.prod(s) for s in extra_kv)
        block_bytes = config.block_size * token_elems * config.torch_dtype.itemsize
        self.kv_pool = KVPool(model.num_kv_layers, self._num_kv_blocks(block_bytes) + spare, config.block_size, num_kv_heads, head_dim, config.torch_dtype, self.device, extra_kv)
        max_blocks_per_seq = -(-(config.max_model_len + k + 1) // config.block_size)
        self.spec: SpecMethod = spec_method_class(config.spec)(model, self.kv_pool, k, self.device, origin=origin,
                                                               cuda_graphs=config.cuda_graphs, max_blocks_per_seq=max_blocks_per_seq)
        # the graphs export the layers the method reads (target_layers), as the eager forward does
        self.graphs = DecodeGraphs(model, self.kv_pool, self.state_pool, self.device, max_blocks_per_seq, config.max_num_seqs,
                                   export_layers=self.spec.target_layers) if use_graphs else None
        self.scheduler = Scheduler(self.kv_pool, self.state_pool, config.max_num_seqs, config.max_num_batched_tokens, k, config.prefill_align)
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache:
            snapshot_bytes, align = int(config.prefix_snapshot_mib * 2**20), self.scheduler.prefill_align
            self.prefix_cache = PrefixCache(self.kv_pool, self.state_pool, self.spec, align, snapshot_bytes)
            self.scheduler.prefix_cache = self.prefix_cache
        self.eos_ids = set(model.eos_token_ids)
        self.stats = StepStats(accepted_per_position=[0] * k)
        self._next_id = 0
        self.in_flight: InFlightStep | None = None

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
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, images: RequestImages | None = None) -> Request:
        """images: the prompt's images, laid out in prompt_token_ids (their pads expanded)."""
        from freetoken.errors import FreetokenError

        if not prompt_token_ids:
            raise FreetokenError("empty prompt")
        if images is not None and self.vision_tower is None:
            raise FreetokenError("this checkpoint has no vision tower, so it cannot take image prompts")
        request = Request(self._next_id, list(prompt_token_ids), params, images=images)
        request.generator = sampling.make_generator(params, self._next_id, self.device, self.config.seed)
        self._next_id += 1
        self.scheduler.add(request)
        if self.prefix_cache is not None:
            self.prefix_cache.add(request)
        return request

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], on_step: Callable[[list[Request]], None] | None = None,
                 images: Sequence[RequestImages | None] | None = None) -> list[Request]:
        """Run every prompt to completion; returns the requests in prompt order. images: per prompt, or None."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        images_list = list(images) if images is not None else [None] * len(prompts)
        requests = [self.add_request(p, sp, im) for p, sp, im in zip(prompts, params_list, images_list)]
        while self.has_work:
            finished = self.step()
            if on_step is not None:
                on_step(finished)
        return requests

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    # -- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Advance the engine by one forward; returns the requests that finished. With a greedy decode
        step in flight, the next one is launched first when it can be (`_follow_up`), then the step in
        flight is read back: its requests finish in the call after the one that launched their last step."""
        finished: list[Request] = []
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            batch = self._follow_up(in_flight)
            if batch:
                launched = self._launch(batch, after=in_flight)
                finished = self._resolve(in_flight)
                if any(r.status is RequestStatus.RUNNING for r in batch):
                    self.in_flight = launched  # else every row of it was computed in vain: nothing to read
                return finished
            finished = self._resolve(in_flight)
        scheduled = self.scheduler.schedule()
        for request in scheduled.preempted:
            self.spec.release(request)
        self.stats.num_preemptions += len(scheduled.preempted)
        if scheduled.prefill:
            self._prefill(scheduled.prefill)
        elif scheduled.decode and self._overlaps(scheduled.decode):
            self.in_flight = self._launch(scheduled.decode)
        elif scheduled.decode:
            finished += self._decode(scheduled.decode)
        return finished

    def _encode_images(self, images: RequestImages | None, first_row: int) -> None:
        """A request's image features, computed once (a chunked or repeated prefill slices them) when a row
        from first_row on (the first not computed yet) is an image pad. A prefix-cache hit past every pad
        needs none: the rows still to compute (target and draft) read only tokens from first_row on. The
        tower always encodes all the images of a request together, so the features do not depend on the hit."""
        if images is not None and images.features is None and images.has_pads_from(first_row):
            tower = self.vision_tower
            pixels = images.pixel_values.to(device=self.device, dtype=next(tower.parameters()).dtype)
            images.features = tower(pixels, images.grids).to(self.config.torch_dtype)

    def _prefill(self, chunks: list[PrefillChunk]) -> None:
        align = self.scheduler.prefill_align
        for chunk in chunks:
            self._encode_images(chunk.request.images, chunk.start)
        groups = [RowGroup(c.request.block_table, c.request.state_slot, c.start, c.request.token_ids[c.start : c.start + c.length],
                           chunkable_end=c.request.chunkable_end(align), images=c.request.images) for c in chunks]
        ctx = build_context(groups, ForwardMode.EXTEND, self.kv_pool, self.state_pool, self.device)
        hidden, layer_hidden = run_target(self.model, ctx, self.spec.target_layers)
        committed = []
        for chunk, seq in zip(chunks, ctx.seqs):
            request = chunk.request
            request.num_cached_tokens += chunk.length
            tokens = request.token_ids
            committed.append(CommittedRows(request, chunk.start, hidden[seq.rows], tokens[chunk.start + 1 : chunk.start + chunk.length + 1],
                                           None if layer_hidden is None else layer_hidden[seq.rows]))
            self.stats.prefill_tokens += chunk.length
        self.spec.observe(committed)
        if self.prefix_cache is not None:
            for chunk in chunks:
                self.prefix_cache.after_prefill(chunk.request)

    def _verify(self, requests: list[Request], groups: list[RowGroup], proposal) -> tuple[torch.Tensor, torch.Tensor | None, list[int], list[int]]:
        """Target forward over every request's k+1 rows, verify, commit -> (hidden [B*(k+1), H], the
        method's target layers' outputs [B*(k+1), n*H] or None, accepted drafts, next tokens)."""
        k = self.spec.num_draft_tokens
        mode = ForwardMode.VERIFY if k > 0 else ForwardMode.EXTEND
        greedy = all(r.params.is_plain_greedy for r in requests)
        if self.graphs is not None and self.graphs.covers(groups):
            step = self.graphs.run(groups, mode, greedy)  # outputs of padding rows follow the requests' rows
            rows = len(requests) * (k + 1)
            layer_hidden = None if step.layer_hidden is None else step.layer_hidden[:rows]
            if greedy:  # verify and commit ran inside the graph
                accepted, next_tokens = step.result[:, : len(requests)].tolist()
                return step.hidden[:rows], layer_hidden, accepted, next_tokens
            result = self._sample(step.logits[:rows], requests, proposal)
            if k > 0:
                self.graphs.commit(step, result.accepted_len + 1)  # on the device: no host round trip first
            return step.hidden[:rows], layer_hidden, result.accepted_len.tolist(), result.next_token.tolist()
        ctx = build_context(groups, mode, self.kv_pool, self.state_pool, self.device)
        hidden, layer_hidden = run_target(self.model, ctx, self.spec.target_layers)
        result = self._sample(self.model.compute_logits(hidden), requests, proposal)
        accepted = result.accepted_len.tolist()
        if k > 0:
            self.model.commit(ctx, [a + 1 for a in accepted])
        return hidden, layer_hidden, accepted, result.next_token.tolist()

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

    def _finish(self, request: Request, kept: list[int], done: bool, observed_tokens: int) -> None:
        """End a request whose last step kept `kept`: hand its first observed_tokens tokens (those the spec
        method has seen) to the prefix cache, free its blocks and slot, drop its draft state."""
        if self.prefix_cache is not None:
            self.prefix_cache.finish(request, observed_tokens)
        self.scheduler.finish(request, self._finish_reason(request, kept, done))
        self.spec.release(request)

    def _finish_reason(self, request: Request, kept: list[int], done: bool) -> str:
        """"stop" for an EOS or stop token, "length" for max_new_tokens or the model length."""
        last = kept[-1] if kept else None
        stopped = last in request.params.stop_token_ids or (last in self.eos_ids and not request.params.ignore_eos)
        return "stop" if done and stopped else "length"

    def _decode(self, requests: list[Request]) -> list[Request]:
        k = self.spec.num_draft_tokens
        proposal = self.spec.propose(requests)
        drafts = proposal.tokens.tolist()
        groups = [RowGroup(r.block_table, r.state_slot, r.num_cached_tokens, [r.last_token_id] + d, images=r.images) for r, d in zip(requests, drafts)]
        hidden, layer_hidden, accepted, next_tokens = self._verify(requests, groups, proposal)
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
                self._finish(request, kept, done, observed_tokens=start)
                finished.append(request)
            else:
                self.kv_pool.trim(request.block_table, request.num_cached_tokens)
                committed.append(CommittedRows(request, start, hidden[rows][: a + 1], emitted, None if layer_hidden is None else layer_hidden[rows][: a + 1]))
        self.spec.observe(committed)
        return finished

    # -- overlapped greedy decode --------------------------------------------------------------------
    def _overlaps(self, requests: list[Request]) -> bool:
        """Whether a decode step of these requests is launched without reading its tokens back: greedy
        without penalties and without drafts (k = 0 drafts nothing, so the method gets no rows to observe)."""
        return self.config.overlap and self.spec.num_draft_tokens == 0 and all(r.params.is_plain_greedy for r in requests)

    def _follow_up(self, in_flight: InFlightStep) -> list[Request]:
        """The batch of a decode step that may be launched before in_flight is read back, its block tables
        grown; [] when the next step is not known yet (then nothing changed).

        It is in_flight's batch less the requests that finished and those that end at in_flight whatever
        its token (max_new_tokens, max_model_len), when that batch is every running request and the
        scheduler needs neither admission nor preemption. A request that stops at in_flight on a stop
        token is in it: its row of the follow-up is dropped when in_flight is read back."""
        live = [r for r in in_flight.requests if r.status is RequestStatus.RUNNING]
        if len(live) != len(self.scheduler.running) or any(a is not b for a, b in zip(live, self.scheduler.running)):
            return []
        batch = [r for r in live if len(r.output_token_ids) < r.params.max_new_tokens and r.num_tokens < self.config.max_model_len]
        return batch if batch and self.scheduler.continue_decode(batch) else []

    def _launch(self, requests: list[Request], after: InFlightStep | None = None) -> InFlightStep:
        """Launch a greedy k = 0 decode step and queue the copy of its next tokens to the host, without
        waiting for it. Each request's output gets a PENDING token and its row is counted as cached.

        after: the step in flight whose next tokens are this step's input tokens, taken on the device
        (each request's row there); None: the requests' last tokens are known."""
        groups = [RowGroup(r.block_table, r.state_slot, r.num_cached_tokens, [r.last_token_id], images=r.images) for r in requests]
        fed_back_rows = None
        if after is not None:
            row_of = {id(r): i for i, r in enumerate(after.requests)}
            fed_back_rows = [row_of[id(r)] for r in requests]
        # a graph takes fed-back tokens from last_tokens, which only a graph step writes
        by_graph = self.graphs is not None and self.graphs.covers(groups) and (after is None or after.by_graph)
        if by_graph:
            next_tokens = self.graphs.run(groups, ForwardMode.EXTEND, greedy=True, fed_back_rows=fed_back_rows).result[1, : len(requests)]
        else:
            ctx = build_context(groups, ForwardMode.EXTEND, self.kv_pool, self.state_pool, self.device)
            if after is not None:
                ctx = replace(ctx, input_ids=after.next_tokens.index_select(0, torch.tensor(fed_back_rows, device=self.device)))
            logits = self.model.compute_logits(self.model(ctx))
            no_drafts = torch.empty((len(requests), 0), dtype=torch.long, device=self.device)
            next_tokens = sampling.greedy_verify(logits.view(len(requests), 1, -1), no_drafts).next_token
        host_tokens, copied = next_tokens, None
        if next_tokens.device.type == "cuda":
            host_tokens = torch.empty(next_tokens.shape, dtype=next_tokens.dtype, pin_memory=True)
            host_tokens.copy_(next_tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        launched = InFlightStep(requests, [len(r.output_token_ids) for r in requests], next_tokens, host_tokens, copied, by_graph)
        for request in requests:
            request.output_token_ids.append(PENDING)
            request.num_cached_tokens += 1
        self.stats.decode_steps += 1
        self.stats.overlapped_steps += after is not None
        return launched

    def _resolve(self, in_flight: InFlightStep) -> list[Request]:
        """Read an in-flight step's tokens back into the outputs and stop its requests as `_decode` would;
        a finishing request drops the PENDING token of a step launched after this one -> the finished requests."""
        finished: list[Request] = []
        for request, index, token in zip(in_flight.requests, in_flight.output_index, in_flight.tokens()):
            if request.status is not RequestStatus.RUNNING:
                continue  # it finished at the step before, after this one was launched
            request.output_token_ids[index] = token
            request.num_target_steps += 1
            self.stats.generated_tokens += 1
            _, done = sampling.apply_stop([token], request.params, self.eos_ids, index)
            if done or len(request.prompt_token_ids) + index + 1 >= self.config.max_model_len:
                request.num_cached_tokens -= len(request.output_token_ids) - (index + 1)
                del request.output_token_ids[index + 1 :]
                self._finish(request, [token], done, observed_tokens=request.num_cached_tokens)
                finished.append(request)
        return finished
