"""ModelRunner: turns a SchedulerOutput into one forward pass plus sampling, and answers in plain lists."""
from __future__ import annotations

import logging

import torch

from pagedllm.attention import AttentionMetadata, get_attn_backend
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.input_batch import BatchInputs, InputBatch

logger = logging.getLogger("pagedllm")


def _to_lists(lp, ks: list[int] | None = None) -> list[LogprobsLists]:
    """Splits LogprobsTensors rows into per-row LogprobsLists, keeping 1 + k columns for row i."""
    ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    out = []
    for i in range(len(ids)):
        k = 1 + (ks[i] if ks is not None else len(ids[i]) - 1)
        out.append(LogprobsLists([ids[i][:k]], [vals[i][:k]], [ranks[i]]))
    return out


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.attn_backend = get_attn_backend(config.attention_backend, device.type)
        self.input_batch = InputBatch(self.block_size)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = None

    def load_model(self) -> None:
        from pagedllm.model_loader.loader import get_model
        from pagedllm.sample.sampler import Sampler

        self.model = get_model(self.model_config, self.config.load_config, self.device, self.attn_backend)
        self.sampler = Sampler()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, mc.num_kv_heads, mc.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=mc.dtype, device=self.device) for _ in range(mc.num_layers)]

    def _attn_metadata(self, b: BatchInputs) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            num_actual_tokens=len(b.input_ids),
            num_reqs=len(b.req_ids),
            max_query_len=int(max(b.query_start_loc[1:] - b.query_start_loc[:-1])),
            max_seq_len=int(b.seq_lens.max()),
            query_start_loc=torch.from_numpy(b.query_start_loc).to(dev),
            seq_lens=torch.from_numpy(b.seq_lens).to(dev),
            block_table=torch.from_numpy(b.block_table).to(dev),
            slot_mapping=torch.from_numpy(b.slot_mapping).to(dev),
            query_start_loc_cpu=b.query_start_loc.tolist(),
            seq_lens_cpu=b.seq_lens.tolist(),
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.input_batch.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        b = self.input_batch.prepare(so)
        md = self._attn_metadata(b)
        input_ids = torch.from_numpy(b.input_ids).to(self.device)
        positions = torch.from_numpy(b.positions).to(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, md)  # [T, hidden]

        prompt_logprobs = self._prompt_logprobs(b, hidden)
        rows = [i for i, keep in enumerate(b.sampling_mask) if keep]
        sampled: list[list[int]] = [[] for _ in b.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if rows:
            last_tok = torch.as_tensor(b.query_start_loc[1:][rows] - 1, device=self.device)
            logits = self.model.compute_logits(hidden[last_tok])  # [S, vocab] float32
            states = [self.input_batch.requests[b.req_ids[i]] for i in rows]
            token_ids, lp = self._sample(logits, states)
            want = [st.sampling_params.logprobs for st in states]
            lp_lists = _to_lists(lp, [k or 0 for k in want]) if lp is not None else None
            for j, (i, st) in enumerate(zip(rows, states)):
                st.output_token_ids.append(token_ids[j])
                sampled[i] = [token_ids[j]]
                if want[j] is not None and lp_lists is not None:
                    logprobs[st.req_id] = lp_lists[j]
        return ModelRunnerOutput(
            req_ids=b.req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )

    def _sample(self, logits: torch.Tensor, states: list) -> tuple[list[int], object]:
        from pagedllm.sample.metadata import build_sampling_metadata

        md = build_sampling_metadata(
            params=[st.sampling_params for st in states],
            prompt_token_ids=[st.prompt_token_ids for st in states],
            output_token_ids=[st.output_token_ids for st in states],
            seeds=[st.seed for st in states],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, md)
        return out.sampled_token_ids.tolist(), out.logprobs

    def _prompt_logprobs(self, b: BatchInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token given its prefix, for the prompt positions in this step."""
        from pagedllm.sample.logprobs import compute_token_logprobs

        out: dict[str, LogprobsLists] = {}
        for i, rid in enumerate(b.req_ids):
            st = self.input_batch.requests[rid]
            k = st.sampling_params.prompt_logprobs
            if k is None:
                continue
            start_tok, end_tok = int(b.query_start_loc[i]), int(b.query_start_loc[i + 1])
            start_pos = int(b.positions[start_tok])
            num_prompt = len(st.prompt_token_ids)
            # Hidden state at position p predicts prompt token p + 1.
            n = min(end_tok - start_tok, num_prompt - 1 - start_pos)
            if n <= 0:
                continue
            logits = self.model.compute_logits(hidden[start_tok : start_tok + n])
            targets = torch.tensor(st.prompt_token_ids[start_pos + 1 : start_pos + 1 + n], device=self.device)
            lp = compute_token_logprobs(logits, targets, k)
            rows = _to_lists(lp)
            out[rid] = LogprobsLists(
                [r.token_ids[0] for r in rows], [r.logprobs[0] for r in rows], [r.ranks[0] for r in rows]
            )
        return out

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward pass over ``num_tokens`` prompt tokens without a KV cache, to measure activations."""
        mc = self.model_config
        n_blocks = -(-num_tokens // self.block_size)
        shape = self.attn_backend.get_kv_cache_shape(n_blocks, self.block_size, mc.num_kv_heads, mc.head_size)
        caches = [torch.zeros(shape, dtype=mc.dtype, device=self.device) for _ in range(mc.num_layers)]
        md = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=1,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_table=torch.arange(n_blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        hidden = self.model(ids, pos, caches, md)
        self.model.compute_logits(hidden[-min(num_tokens, self.config.scheduler_config.max_num_seqs) :])
        del caches
