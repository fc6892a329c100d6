"""GGUF weights kept packed on a real GPU: the Triton dequantize-in-the-loop product against the torch decoders'
dense weight in float32 and bfloat16, and an engine on CUDA whose packed weights give the dense path's greedy
tokens on tiny files of each type."""
from __future__ import annotations

import os
import sys

import pytest
import torch

gguf = pytest.importorskip("gguf")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model_loader"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "layers"))
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_gguf_packed import PROMPTS, mixed, write_gguf  # noqa: E402
from test_gguf_triton import _packed  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.kernels.gguf_triton import gguf_mm_triton  # noqa: E402
from pagedllm.layers.quantization.gguf_dequant import dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TRITON_TYPES = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q6_K]


@pytest.mark.parametrize("qtype", TRITON_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_equals_the_dequantized_weights(qtype, m, dtype):
    n, k = 384, 1024
    packed = _packed(qtype, n, k, seed=m)
    dense = dequantize(packed, qtype, (n, k)).cuda()  # [n, k] float32
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).cuda()
    got = gguf_mm_triton(x.to(dtype), packed.cuda(), qtype)
    want = x.double() @ dense.double().t()
    # float32: summation order only (tf32 off in the kernel); bfloat16: the input's and output's rounding.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def _greedy(path: str, dtype: str, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, dtype=dtype, device="cuda", skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory_bytes=1 << 26, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch,qtype", [("llama", T.Q4_K), ("llama", T.Q8_0), ("qwen2", T.Q6_K), ("gemma3", None)],
                         ids=["llama-Q4_K", "llama-Q8_0", "qwen2-Q6_K", "gemma3-mixed"])
def test_engine_on_cuda_keeps_packed_weights_and_matches_dense(arch, qtype, tmp_path):
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, arch, mixed if qtype is None else (lambda name: qtype))
    packed_tokens, llm = _greedy(path, "float32")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    assert any(t.dtype == torch.uint8 and t.is_cuda for t in tensors), "no packed weight stayed on the GPU"
    del llm
    dense_tokens, _ = _greedy(path, "float32", gguf_dequantize=True)
    assert packed_tokens == dense_tokens
