"""ModelRunner: turns a SchedulerOutput into one forward pass plus sampling, and answers in plain lists.

Per step: InputBatch flattens the scheduled requests into host arrays; StepBuffers packs them into
pinned memory and sends them to the device in one non-blocking copy; a pure-decode batch replays the
CUDA graph of its padded size and a mixed batch the graph of its padded token count (cuda_graphs.py),
anything larger runs eagerly; then logits, sampling on
the device, and a non-blocking copy of the sampled ids to the host behind an event, the step's only
wait for the GPU. ``submit`` launches a step and ``take_output`` waits for it, so the engine core can
schedule step N+1 while step N runs: tokens that step N is still sampling reach step N+1's inputs by
a copy on the device.
"""
from __future__ import annotations

import logging
import time
from collections import deque
import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, get_attn_backend
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.distributed.pipeline import IntermediateTensors, stage_layer_range
from pagedllm.sample.argmax import argmax_rows
from pagedllm.sample.validity import INVALID_TOKEN_ID, check_sampled
from pagedllm.worker.cuda_graphs import CudaGraphRunner, graph_sizes
from pagedllm.worker.gpu_buffers import DeviceInputs, StepBuffers
from pagedllm.worker.input_batch import BatchInputs, InputBatch
from pagedllm.worker.step_records import (
    DeferredSampling, ForwardPass, LogprobsTensorsOnHost, StepInFlight, StepInfo, last_token_rows, logprobs_to_lists,
)
from pagedllm.worker.step_sampling import prompt_logprobs_of, sample_isolating, sample_states
from pagedllm.worker.warmup_runs import profile_run, warm_up_kernels

logger = logging.getLogger("pagedllm")

# Attention backends whose forward launches no host synchronisation and reads every per-step value
# from device tensors, so it can be captured into a CUDA graph.
_GRAPH_SAFE_BACKENDS = frozenset({"triton"})
# Mixed steps of a graph-safe backend launch attention as for at least this longest query run, which
# fixes its tile at the 64-row maximum: a mixed graph (captured for its padded token count) and an
# eager step of the same batch then launch the same kernel and compute bit-identical results.
MIXED_QUERY_LEN_BOUND = 64
_NO_VALID_TOKEN = ("the model's logits for this request hold no valid token (NaN or infinite values, "
                   "or every token masked)")


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        sc = config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = sc.max_model_len
        self.max_num_seqs = sc.max_num_seqs
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.attn_backend = get_attn_backend(config.attention_backend, device.type)
        # Under tensor/pipeline parallelism: this rank's layers and KV heads, and whether it samples (the
        # first tensor rank of the last stage; the others learn the tokens from the executor).
        pp, tp = get_pp_group(), get_tp_group()
        self.pp_group = pp
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.is_driver = pp.is_last_rank and tp.is_first_rank
        self.layer_start, self.layer_end = stage_layer_range(self.model_config.num_layers, pp.rank_in_group,
                                                             pp.world_size)
        self.num_kv_heads = self.model_config.num_kv_heads_per_rank(tp.world_size)
        self.num_heads = self.model_config.num_heads // tp.world_size
        self.input_batch = InputBatch(self.block_size, self.max_num_seqs, self.max_blocks_per_req)
        graph_safe = getattr(self.attn_backend, "name", "") in _GRAPH_SAFE_BACKENDS
        gc = config.graph_config
        self.use_cuda_graphs = (device.type == "cuda" and graph_safe and not config.enforce_eager
                                and (gc.decode_graphs or gc.mixed_graphs))
        # Decode steps launch attention as for a max_model_len context whenever graphs are possible,
        # eager or not: graphs must (a graph keeps the launch it was captured with), and eager decode
        # doing the same makes graph and eager runs compute bit-identical results.
        self.decode_len_bound = self.max_model_len if graph_safe else None
        self.mixed_query_len_bound = MIXED_QUERY_LEN_BOUND if graph_safe else None
        self._logits_out: torch.Tensor | None = None  # [max_num_seqs, vocab shard] (_logits)
        # A mixed graph's batch always has this many requests: every request the scheduler may run,
        # plus one padding request that owns the padding tokens.
        self.mixed_graph_reqs = self.max_num_seqs + 1
        self.buffers = StepBuffers(
            device,
            max_tokens=max(sc.max_num_batched_tokens, self.max_num_seqs),
            max_reqs=self.mixed_graph_reqs,
            max_blocks_per_req=self.max_blocks_per_req,
        )
        self.graph_runner: CudaGraphRunner | None = None  # pure-decode batches, by padded request count
        self.mixed_graph_runner: CudaGraphRunner | None = None  # other batches, by padded token count
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = None
        self.last_step: StepInfo | None = None
        # The last submitted step while its output is not resolved, and resolved outputs not yet taken.
        self._in_flight: StepInFlight | None = None
        self._done: deque[ModelRunnerOutput] = deque()
        # A submitted step whose sampling is not launched yet.
        self._deferred: DeferredSampling | None = None
        # Device time of each step, for the engine core's just-in-time submission (two timed events a step).
        self.time_steps = device.type == "cuda" and sc.submit_just_in_time
        # Data parallelism with expert parallelism: every step is a model call, an empty one included (the
        # other cores' ranks wait in its MoE layers' collectives).
        self.dummy_when_empty = config.parallel_config.dp_expert_parallel

    def load_model(self) -> None:
        from pagedllm.layers.kv_scales import use_kv_scales
        from pagedllm.model_loader.loader import get_model
        from pagedllm.sample.sampler import Sampler

        self.model = get_model(self.model_config, self.config.load_config, self.device, self.attn_backend)
        use_kv_scales(self.model, self.config.kv_cache_dtype)
        eager = sorted({repr(m.experts_method) for m in self.model.modules()
                        if not getattr(getattr(m, "experts_method", None), "cuda_graph_safe", True)})
        if self.use_cuda_graphs and eager:
            # Their per-expert loop sizes each expert's rows on the host, which a replayed graph cannot.
            logger.warning("CUDA graphs off: the model's experts (%s) run a per-expert loop; steps run eagerly",
                           ", ".join(eager))
            self.use_cuda_graphs = False
        self.sampler = Sampler()

    def prepack_cpu_weights(self) -> int:
        """Reorders the CPU linears' float32 weights into oneDNN's layout now instead of in the first step,
        so that the KV cache is sized after the packed copies take their RAM. Returns how many were packed."""
        from pagedllm.layers.cpu_linear import PackedWeight, prepack

        return sum(
            prepack(m.weight, m.packed_weight)
            for m in self.model.modules()
            if isinstance(getattr(m, "packed_weight", None), PackedWeight)
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, mc.head_size)
        # No kernel reads a slot before it is written (the backends mask or redirect every position past a
        # request's end). On the CPU, zero-filling gigabytes up front took seconds of start-up; left
        # unwritten, the OS maps each page when a block first fills. A GPU memset is nearly free: keep it.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        dtype = self.config.kv_cache_dtype
        num_layers = self.layer_end - self.layer_start  # this pipeline stage's
        self.kv_caches = [alloc(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    # ---- CUDA graphs -------------------------------------------------------------------------------
    def _decode_metadata(self, num_reqs: int, dev: DeviceInputs) -> AttentionMetadata:
        """Metadata of a padded pure-decode batch read entirely from device views; host values are bounds."""
        return AttentionMetadata(
            num_actual_tokens=num_reqs,
            num_reqs=num_reqs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens,
            block_table=dev.block_table,
            slot_mapping=dev.slot_mapping,
            # Only the reference backend reads these, and it is never captured.
            query_start_loc_cpu=list(range(num_reqs + 1)),
            seq_lens_cpu=[0] * num_reqs,
            decode_order=dev.decode_order,
        )

    def _static_decode_forward(self, num_reqs: int) -> torch.Tensor:  # -> [num_reqs, H]
        dev = self.buffers.decode_views(num_reqs)
        md = self._decode_metadata(num_reqs, dev)
        return self.model(dev.input_ids, dev.positions, self.kv_caches, md)

    def _static_mixed_forward(self, num_tokens: int) -> torch.Tensor:  # -> [num_tokens or mixed_graph_reqs, H]
        """A mixed batch padded to ``num_tokens`` tokens and ``mixed_graph_reqs`` requests; host values are bounds.
        One row per request slot where the graph prunes (``_mixed_graph_prunes``)."""
        reqs = self.mixed_graph_reqs
        dev = self.buffers.static_views(num_tokens, reqs)
        rows = last_token_rows(dev.query_start_loc) if self._mixed_graph_prunes(num_tokens) else None
        md = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=reqs,
            max_query_len=max(num_tokens, self.mixed_query_len_bound),
            max_seq_len=self.max_model_len,
            query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens,
            block_table=dev.block_table,
            slot_mapping=dev.slot_mapping,
            query_start_loc_cpu=[0] * (reqs + 1),
            seq_lens_cpu=[0] * reqs,
        )
        return self.model(dev.input_ids, dev.positions, self.kv_caches, md, rows)

    @torch.inference_mode()
    def capture_cuda_graphs(self, capture: bool | None = None) -> float:
        """Captures the mixed-batch and decode graphs (needs the model and the KV cache). Returns seconds.

        ``capture=False`` sets up the same padded static-input paths without graphs, for tests on CPU.
        """
        if not self.use_cuda_graphs:
            return 0.0
        if capture is None:
            capture = self.device.type == "cuda"
        # The mixed graphs first: the largest of them sets the shared pool's size for all the others.
        mixed_sizes, decode_sizes = graph_sizes(self.config.graph_config, self.max_num_seqs,
                                                self.config.scheduler_config.max_num_batched_tokens)
        mixed = CudaGraphRunner(mixed_sizes, capture)
        seconds = mixed.capture(
            self._static_mixed_forward, lambda n: self.buffers.upload_dummy(n, self.mixed_graph_reqs)
        )
        decode = CudaGraphRunner(decode_sizes, capture=capture)
        seconds += decode.capture(
            self._static_decode_forward, lambda n: self.buffers.upload_dummy(n, n), pool=mixed.pool
        )
        self.mixed_graph_runner, self.graph_runner = mixed, decode
        return seconds

    # ---- one step ----------------------------------------------------------------------------------
    def _attn_metadata(self, b: BatchInputs, dev: DeviceInputs) -> AttentionMetadata:
        max_seq_len, max_query_len = b.max_seq_len, b.max_query_len
        if b.is_pure_decode and self.decode_len_bound is not None:
            max_seq_len = self.decode_len_bound
        elif not b.is_pure_decode and self.mixed_query_len_bound is not None:
            max_query_len = max(max_query_len, self.mixed_query_len_bound)
        return AttentionMetadata(
            num_actual_tokens=b.num_tokens,
            num_reqs=b.num_reqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens,
            block_table=dev.block_table,
            slot_mapping=dev.slot_mapping,
            query_start_loc_cpu=b.query_start_loc.tolist(),
            seq_lens_cpu=b.seq_lens.tolist(),
            decode_order=dev.decode_order if b.is_pure_decode else None,
        )

    @staticmethod
    def _fill_pending(dev: DeviceInputs, prev: StepInFlight | None) -> None:
        """Copies the previous step's sampled ids, still on the device, into this step's input ids."""
        if dev.pending_dst.numel():
            dev.input_ids.index_copy_(0, dev.pending_dst, prev.token_ids.index_select(0, dev.pending_src))

    def _forward(self, b: BatchInputs, prev: StepInFlight | None) -> ForwardPass:
        """Launches the step's forward pass: a graph's replay where one fits the batch, else eagerly.

        Outside pure decode, only each request's last token is carried through the last layer's
        projection and MLP (where graphs are possible, only in steps of more tokens than a mixed graph's
        request slots), unless some request wants prompt logprobs, which read every row: such a step then
        runs unpruned, eagerly where its graph would prune.
        """
        decode = b.is_pure_decode
        every_row = not decode and self._wants_prompt_logprobs(b)
        runner = (self.graph_runner if decode else self.mixed_graph_runner) if self.use_cuda_graphs else None
        size = runner.bucket_for(b.num_reqs if decode else b.num_tokens) if runner is not None else None
        per_request = bool(size) and not decode and self._mixed_graph_prunes(size)
        if size and not (every_row and per_request):
            # A decode graph's batch is `size` one-token requests; a mixed graph's, `size` tokens over
            # a fixed number of requests.
            reqs = size if decode else self.mixed_graph_reqs
            dev = self.buffers.upload(b, reqs, self.max_blocks_per_req, num_tokens_padded=size)
            self._fill_pending(dev, prev)
            return ForwardPass(runner.replay(size), dev, size if decode else 0, 0 if decode else size, per_request)
        dev = self.buffers.upload(b)
        self._fill_pending(dev, prev)
        rows = None
        if not (decode or every_row) and (self.mixed_query_len_bound is None or self._mixed_graph_prunes(b.num_tokens)):
            rows = last_token_rows(dev.query_start_loc)
            if self.mixed_query_len_bound is not None:
                # Where graphs are possible, as a mixed graph would: one row per request slot, so that a
                # graph and an eager pass of the same batch run the last layer at the same sizes.
                rows = torch.nn.functional.pad(rows, (0, self.mixed_graph_reqs - b.num_reqs))
        hidden = self._stage_forward(dev.input_ids, dev.positions, self._attn_metadata(b, dev), rows)
        return ForwardPass(hidden, dev, 0, 0, rows is not None)

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                       rows: torch.Tensor | None) -> torch.Tensor | IntermediateTensors:
        """The model's forward on this pipeline stage: a stage after the first receives the previous one's
        hidden states and residual, a stage before the last sends its own on (and returns them)."""
        intermediate = None
        if not self.is_first_stage:
            intermediate = IntermediateTensors.recv(self.pp_group, self.model_config.dtype, self.device)
        out = self.model(input_ids, positions, self.kv_caches, md, rows, intermediate)
        if not self.is_last_stage:
            out.send(self.pp_group)
        return out

    def _mixed_graph_prunes(self, num_tokens: int) -> bool:
        """Whether the mixed graph of ``num_tokens`` carries only last tokens (one row per request slot,
        padding included) through the last layer: only when that is fewer rows than its tokens."""
        return num_tokens > self.mixed_graph_reqs

    def _wants_prompt_logprobs(self, b: BatchInputs) -> bool:
        states = (self.input_batch.requests.get(rid) for rid in b.req_ids)
        return any(st is not None and st.sampling_params.prompt_logprobs is not None for st in states)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step to completion; under data parallelism with expert parallelism an empty step runs the
        MoE layers' collectives over zero tokens (``execute_dummy_batch``)."""
        self.submit(so)
        if so.total_num_scheduled_tokens == 0:
            if self.dummy_when_empty:
                self.execute_dummy_batch()
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.take_output()

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """This core's share of a step in which it has no tokens: every MoE layer's all-to-alls, in order,
        with nothing to send, so that the cores that do have tokens get their experts' results."""
        from pagedllm.layers.fused_moe.layer import run_moe_collectives

        run_moe_collectives(self.model)

    @torch.inference_mode()
    def submit(self, so: SchedulerOutput, defer_sampling: bool = False) -> float:
        """Launches one step: inputs, forward pass, sampling, and the copy of the sampled ids to the host.

        Nothing here waits for this step. If the previous step is still in flight, its sampled ids feed
        this step's pending tokens on the device, and its output is resolved (waited for) only after
        this step's forward pass is queued, so the device never idles on it. Returns the host seconds
        until that forward pass was queued: what just-in-time submission must budget before the device
        runs out of work (the wait and the sampling launches after it are not on that path).
        ``defer_sampling``: stop after resolving the previous step, so that its output can be taken and
        sent on while the forward pass runs; ``launch_sampling`` (or the next call here) then finishes.
        """
        t_call = time.perf_counter()
        self.launch_sampling()
        self.input_batch.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return 0.0
        prev = self._in_flight
        b = self.input_batch.prepare(so)
        if b.pending_req_ids:
            if prev is None:
                raise RuntimeError(f"requests {b.pending_req_ids} wait for tokens that no step is sampling")
            b.pending_src = np.array([prev.sampled_row[rid] for rid in b.pending_req_ids], dtype=np.int64)
        start_event = None
        if self.time_steps:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        fwd = self._forward(b, prev)  # the GPU is busy from here on
        launch_s = time.perf_counter() - t_call
        self.last_step = StepInfo(b.num_reqs, b.num_tokens, int(b.seq_lens.sum()), fwd.graph_size, fwd.graph_tokens)

        if prev is not None:
            # The previous step's tokens are needed on the host before this step samples (penalties,
            # seeds and stop checks read each request's output so far).
            self._done.append(self._resolve(prev))
            self._in_flight = None
        self._deferred = DeferredSampling(b, fwd, start_event, so)
        if not defer_sampling:
            self.launch_sampling()
        return launch_s

    @torch.inference_mode()
    def launch_sampling(self) -> None:
        """Launches the sampling of the step whose forward pass ``submit`` left it behind, if any."""
        if self._deferred is None:
            return
        b, fwd, start_event, so = self._deferred
        hidden, dev, per_request = fwd.hidden, fwd.dev, fwd.per_request
        self._deferred = None
        if not self.is_last_stage:  # the hidden states went on to the next stage; nothing to sample here
            self._in_flight = StepInFlight(b.req_ids, {}, start_event=start_event)
            return
        prompt_logprobs = prompt_logprobs_of(b, hidden, self.input_batch.requests, self.model, self.device)
        step = StepInFlight(b.req_ids, prompt_logprobs, start_event=start_event)
        num_sampled = len(b.logits_indices)
        if num_sampled:
            rows = np.flatnonzero(np.asarray(b.sampling_mask)).tolist()
            states = [self.input_batch.requests[b.req_ids[i]] for i in rows]
            if num_sampled == b.num_tokens:
                # Every token is some request's last one (pure decode): rows 0..T-1 in order.
                last_hidden = hidden[:num_sampled]
            elif per_request:
                last_hidden = hidden.index_select(0, dev.logits_reqs)
            else:
                last_hidden = hidden.index_select(0, dev.logits_indices)
            logits = self._logits(last_hidden)
            if logits is None:  # gathered on another tensor rank, which samples
                self._in_flight = step
                return
            if so.grammar_bitmask is not None:  # filled by the engine core up to the sampling launch
                from pagedllm.structured_output.apply import apply_grammar_bitmask

                apply_grammar_bitmask(logits, [st.req_id for st in states], so.grammar_rows, so.grammar_bitmask)
            if all(st.plain_greedy for st in states):
                # What the sampler does for an all-greedy batch, minus building its metadata and the
                # float32 copy of the logits ([S, vocab] in the model dtype; the argmax is the same).
                token_ids, checked = check_sampled(logits, argmax_rows(logits))
                lp = None
            else:
                token_ids, checked, lp, step.errors = sample_isolating(self._sample, logits, states, self.device)
            step.rows, step.states, step.token_ids = rows, states, token_ids
            step.sampled_row = {st.req_id: j for j, st in enumerate(states)}
            # Sent to pinned host memory behind this step's kernels; _resolve waits for the event.
            step.host_token_ids = checked.to("cpu", non_blocking=True)
            if lp is not None:
                step.host_logprobs = (
                    lp.token_ids.to("cpu", non_blocking=True),
                    lp.logprobs.to("cpu", non_blocking=True),
                    lp.ranks.to("cpu", non_blocking=True),
                )
                step.want = [st.sampling_params.logprobs for st in states]
            if self.device.type == "cuda":
                step.event = torch.cuda.Event(enable_timing=start_event is not None)
                step.event.record()
        self._in_flight = step

    @torch.inference_mode()
    def take_output(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not yet taken; waits for it if it is still running."""
        if self._done:
            return self._done.popleft()
        self.launch_sampling()
        if self._in_flight is None:
            raise RuntimeError("take_output() without a submitted step")
        step, self._in_flight = self._in_flight, None
        return self._resolve(step)

    def apply_sampled_tokens(self, sampled: dict[str, list[int]]) -> None:
        """On a rank that does not sample: the tokens the sampling rank drew in the last step, appended to
        the requests' states so that this rank builds the same next inputs."""
        for rid, tokens in sampled.items():
            st = self.input_batch.requests.get(rid)
            if st is not None:
                st.output_token_ids.extend(tokens)

    def reset(self) -> None:
        """Forgets every step in flight and every request (see Executor.reset). A device whose context an
        error has poisoned fails the synchronisation here, which ends the engine."""
        self._in_flight, self._deferred = None, None
        self._done.clear()
        for rid in list(self.input_batch.requests):
            self.input_batch.remove(rid)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _resolve(self, step: StepInFlight) -> ModelRunnerOutput:
        """Waits for a step's sampled ids on the host and turns them into the step's output."""
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        device_time_s = None
        if step.rows:
            if step.event is not None:
                step.event.synchronize()
                if step.start_event is not None:
                    device_time_s = step.start_event.elapsed_time(step.event) / 1e3
            token_ids = step.host_token_ids.tolist()
            lp_lists = None
            if step.host_logprobs is not None:
                lp_lists = logprobs_to_lists(LogprobsTensorsOnHost(*step.host_logprobs), [k or 0 for k in step.want])
            for j, (i, st) in enumerate(zip(step.rows, step.states)):
                if token_ids[j] == INVALID_TOKEN_ID:
                    # Nothing was drawn: the request ends here, and its state must not grow a token.
                    step.errors.setdefault(st.req_id, _NO_VALID_TOKEN)
                    continue
                st.output_token_ids.append(token_ids[j])
                sampled[i] = [token_ids[j]]
                if lp_lists is not None and step.want[j] is not None:
                    logprobs[st.req_id] = lp_lists[j]
        return ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=step.prompt_logprobs,
            device_time_s=device_time_s, errors=step.errors,
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, H] -> [S, vocab]; None: not sampled here
        """The sampled rows' logits, in the model's dtype (float32 under a soft cap); the sampler upcasts
        its own copy. On a GPU they are written into a buffer of max_num_seqs rows kept across steps:
        the rows sampled change every step, and each new largest count used to take a new segment from
        the caching allocator (a cudaMalloc on the host's path) through a batch's first steps. Every use
        of a step's logits is launched before the next step's product, on the same stream."""
        lm = self.model.lm_head
        # A quantized head (GGUF blocks) computes its product through its method, which takes no ``out``.
        if self.device.type != "cuda" or hidden.shape[0] > self.max_num_seqs or lm.quant_method is not None:
            return self.model.compute_logits(hidden, float32=False)
        if self._logits_out is None:
            self._logits_out = torch.empty(self.max_num_seqs, lm.weight.shape[0], dtype=lm.weight.dtype,
                                           device=self.device)
        return self.model.compute_logits(hidden, float32=False, out=self._logits_out)

    def _sample(self, logits: torch.Tensor, states: list):  # [S, vocab] -> SamplerOutput
        return sample_states(self.sampler, logits, states, self.device)

    def warm_up_kernels(self) -> None:
        warm_up_kernels(self)

    def profile_run(self, num_tokens: int) -> None:
        profile_run(self, num_tokens)
