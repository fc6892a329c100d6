"""vLLM engine arguments with no counterpart here: accepted where their value changes nothing, refused by name where it would.

A vLLM script or command line often carries options such as ``disable_log_stats=True`` or
``--swap-space 4``. pagedllm has nothing to apply them to (it preempts by recomputation, runs one
process per rank, logs no periodic stats offline), so at the values that mean "as usual" they are accepted and
dropped with a log line. A value that asks for a feature pagedllm lacks (LoRA,
CPU offload, another tokenizer mode) is an error naming the argument, the value and what is supported.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

logger = logging.getLogger("pagedllm")


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _number_at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= low


def _any_bool(v: Any) -> bool:
    return isinstance(v, bool)


# name: (the values accepted, what they are, the CLI type: bool for a flag, else a converter)
VLLM_ONLY_ARGS: dict[str, tuple[Callable[[Any], bool], str, Any]] = {
    "revision": (_is(None, "main"), "the checkpoint as it is (None or 'main')", str),
    "tokenizer_revision": (_is(None, "main"), "the tokenizer as it is (None or 'main')", str),
    "code_revision": (_is(None, "main"), "None or 'main'", str),
    "tokenizer_mode": (_is("auto", "hf"), "'auto' (the Hugging Face tokenizer)", str),
    "disable_log_stats": (_any_bool, "True or False (no periodic stats are logged offline)", bool),
    "swap_space": (_number_at_least(0), "any size >= 0 (preemption recomputes; nothing is swapped)", float),
    "disable_custom_all_reduce": (_any_bool, "True or False (all-reduce goes through torch.distributed)", bool),
    "max_seq_len_to_capture": (_number_at_least(1), "any length >= 1 (graphs serve every context)", int),
    "cpu_offload_gb": (_is(0), "0", float),
    "enable_lora": (_is(False), "False", bool),
    "task": (_is("auto", "generate"), "'auto' or 'generate'", str),
    "runner": (_is("auto", "generate"), "'auto' or 'generate'", str),
    "generation_config": (_is("auto"), "'auto' (the model's generation_config.json)", str),
    "hf_overrides": (lambda v: not v, "None or {}", None),
    "disable_log_requests": (_any_bool, "True or False (requests are not logged)", bool),
    "enable_log_requests": (_is(False), "False (requests are not logged)", bool),
}


def pop_vllm_only_args(kwargs: dict[str, Any]) -> None:
    """Remove vLLM-only arguments from ``kwargs``: accepted values dropped with a log line, others an error."""
    taken = []
    for name in [k for k in kwargs if k in VLLM_ONLY_ARGS]:
        value = kwargs.pop(name)
        ok, supported, _ = VLLM_ONLY_ARGS[name]
        if not ok(value):
            raise ValueError(f"{name}={value!r} is not supported by pagedllm; it takes {supported}")
        taken.append(f"{name}={value!r}")
    if taken:
        logger.info("vLLM arguments with nothing to change here: %s", ", ".join(taken))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The same arguments as vLLM's command-line flags, so that a vLLM command line parses unchanged."""
    for name, (_, supported, kind) in VLLM_ONLY_ARGS.items():
        if kind is None:
            continue
        flag = "--" + name.replace("_", "-")
        extra: list[str] = []
        if kind is bool:
            parser.add_argument(flag, *extra, action="store_true", default=None, help=f"vLLM's; here {supported}")
        else:
            parser.add_argument(flag, *extra, type=kind, default=None, help=f"vLLM's; here {supported}")


def check_cli_args(args: argparse.Namespace) -> None:
    """Check the vLLM-only flags a command line set (those left unset are None)."""
    pop_vllm_only_args({k: v for k, v in vars(args).items() if k in VLLM_ONLY_ARGS and v is not None})
