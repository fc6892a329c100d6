"""Chat templates rendered in a bounded Jinja sandbox: the globals and filters transformers gives chat
templates (raise_exception, strftime_now, tojson, dict, namespace, {% generation %}), in jinja2's
ImmutableSandboxedEnvironment, with three bounds a template cannot pass:

- size: no string, list or int it builds (`'a' * 300000000`, `~` joins, str.replace, format widths,
  `|indent`, ...) and not its output may exceed `max_chars` characters; the size is checked before the
  value is allocated wherever Python would allocate it in one step;
- time: a line tracer on the rendering thread stops a render that runs past `time_limit_s`, however it
  loops (threads cannot be killed, so the render stops itself);
- source: templates are compiled under the same bounds.

Any bound passed is a TemplateLimitError, which the server answers with a 400.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from datetime import datetime
from string import Formatter
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_CHARS = 32 << 20  # above the default 16 MiB body limit, so a legitimately huge message still renders
TIME_LIMIT_S = 3.0
_MAX_INT_BITS = 1 << 16
_MAX_JSON_INDENT = 16
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_TEMPLATE_FILENAME = "<template>"  # what Jinja names the code of a template made from a string


class TemplateLimitError(BaseException):
    """A render passed a bound. BaseException, so that no `except Exception` in a template's helpers
    (or in Jinja) can swallow it and let the render go on."""


class _Limits:
    def __init__(self, max_chars: int, time_limit_s: float) -> None:
        self.max_chars = max_chars
        self.time_limit_s = time_limit_s
        self.deadline = time.monotonic() + time_limit_s
        self.lines = 0


_local = threading.local()


def _limits() -> _Limits:
    limits = getattr(_local, "limits", None)
    if limits is None:  # the environment is only used inside render_chat, which sets them
        raise TemplateLimitError("chat template used outside a bounded render")
    return limits


def _check_chars(n: int, what: str) -> None:
    limit = _limits().max_chars
    if n > limit:
        raise TemplateLimitError(f"the chat template built {what} of {n} characters or items, more than the limit of {limit}")


def _check_result(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple, dict)):
        _check_chars(len(value), what)
    elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise TemplateLimitError(f"the chat template built an integer of more than {_MAX_INT_BITS} bits")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_PERCENT_SPEC = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(fmt: str, args: Any) -> None:
    """Widths and precisions in printf-style formats ("%999999999d") allocate their whole size."""
    star = False
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for n in (width, precision):
            if n == "*":
                star = True
            elif n:
                _check_chars(int(n), "a %-format width")
    if star:
        for a in args if isinstance(args, tuple) else (args,):
            if _is_int(a):
                _check_chars(abs(a), "a %-format width")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        seq, k = (left, right) if _is_int(right) else (right, left)
        if isinstance(seq, (str, list, tuple)) and _is_int(k):
            _check_chars(len(seq) * max(k, 0), "a repeated value")
        elif _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template built an integer of more than {_MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_chars(len(left) + len(right), "a joined value")
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if right * left.bit_length() > _MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template built an integer of more than {_MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, str):
        _check_percent_format(left, right)


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> None:
    """Methods of str whose result size is set by an argument, checked before they allocate."""
    owner = getattr(method, "__self__", None)
    wrapped = getattr(method, "__wrapped__", None)  # the sandbox's wrapper of str.format
    if wrapped is not None and isinstance(getattr(wrapped, "__self__", None), str):
        for _, _, spec, _ in Formatter().parse(wrapped.__self__):
            for n in re.findall(r"\d+", spec or ""):
                _check_chars(int(n), "a format width")
        return
    if not isinstance(owner, str):
        return
    name = getattr(method, "__name__", "")
    values = list(args) + list(kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill"):
        for v in values:
            if _is_int(v):
                _check_chars(v, f"str.{name}'s width")
    elif name == "expandtabs":
        for v in values:
            if _is_int(v):
                _check_chars(owner.count("\t") * max(v, 0) + len(owner), "str.expandtabs's result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_chars(_replaced_len(owner, args[0], args[1]), "str.replace's result")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        parts = args[0]
        _check_chars(sum(len(p) for p in parts if isinstance(p, str)) + len(owner) * max(len(parts) - 1, 0), "a joined value")


def _replaced_len(s: str, old: str, new: str) -> int:
    count = s.count(old) if old else len(s) + 1
    return len(s) + count * (len(new) - len(old))


def _bounded_filter(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        values = args[1:] if getattr(fn, "jinja_pass_arg", None) is not None else args  # context, eval context or env
        value, rest = (values[0], values[1:]) if values else (None, ())
        for v in list(rest) + list(kwargs.values()):
            if _is_int(v):
                _check_chars(abs(v), f"the {name} filter's argument")
        if name == "replace" and isinstance(value, str) and len(rest) >= 2:
            _check_chars(_replaced_len(value, str(rest[0]), str(rest[1])), "the replace filter's result")
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else width
            if _is_int(width):
                _check_chars(len(value) + (value.count("\n") + 1) * max(width, 0), "the indent filter's result")
        elif name == "join" and isinstance(value, (list, tuple)):
            sep = rest[0] if rest else kwargs.get("d", "")
            texts = sum(len(v) for v in value if isinstance(v, str))
            _check_chars(texts + len(str(sep)) * max(len(value) - 1, 0), "the join filter's result")
        elif name == "format" and isinstance(value, str):
            _check_percent_format(value, tuple(rest))
        return _check_result(fn(*args, **kwargs), f"the {name} filter's result")

    return run


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        # `a ~ b` joins through the environment, so its size is checked before the join.
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateNamespace(Namespace):
    """namespace() that refuses underscore names, which lead to Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with an underscore, got {name!r}")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return _check_result(dict.fromkeys(*args, **kwargs), "a dict")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # HF's tojson: no HTML escaping (unlike Jinja's), and the indent and separators options.
    if indent is not None and (len(indent) if isinstance(indent, str) else indent) > _MAX_JSON_INDENT:
        raise TemplateLimitError(f"tojson's indent is limited to {_MAX_JSON_INDENT}, got {indent!r}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals.pop("lipsum", None)  # its loops are Python's, and no chat template uses it
        self.globals.update(
            raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_result(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        _check_str_method(__obj, args, kwargs)
        return _check_result(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def bounded_concat(self, parts: tuple) -> str:
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        _check_chars(sum(map(len, texts)), "a '~' join")
        return "".join(texts)


_ENV = BoundedEnvironment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    return _ENV.from_string(source)


def _call_tracer(frame: Any, event: str, arg: Any) -> Any:
    # Lines of the template's own code only: every loop of a template runs there, and tracing Jinja's
    # and Python's helpers as well would make every render several times slower.
    return _line_tracer if frame.f_code.co_filename == _TEMPLATE_FILENAME else None


def _line_tracer(frame: Any, event: str, arg: Any) -> Any:
    limits = getattr(_local, "limits", None)
    if limits is None:
        return None
    limits.lines += 1
    if limits.lines & 255 == 0 and time.monotonic() > limits.deadline:
        raise TemplateLimitError(f"the chat template ran longer than its limit of {limits.time_limit_s:g} s")
    return _line_tracer


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    """As transformers hands messages to templates: no None values, and the reasoning under the names
    templates read (reasoning_content, thinking)."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    max_chars: int = MAX_CHARS,
    time_limit_s: float = TIME_LIMIT_S,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation rendered by template `source` (with the request's `tools`, for templates that
    describe them to the model); blocking, so run it off the event loop."""
    chat = [_normalize(m) for m in messages]
    final = None
    if continue_final_message:
        final = chat[-1].get("content") if chat else None
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs a final message with text content")
        chat[-1]["content"] = final + _CONTINUE_TAG
    _local.limits = _Limits(max_chars, time_limit_s)
    previous = sys.gettrace()
    sys.settrace(_call_tracer)
    try:
        template = _compile(source)
        out: list[str] = []
        size = 0
        for piece in template.generate(
            messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
        ):
            size += len(piece)
            _check_chars(size, "an output")
            out.append(piece)
        text = "".join(out)
    finally:
        sys.settrace(previous)
        _local.limits = None
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if tag not in text:
            raise ValueError("continue_final_message is set, but the chat template dropped the final message")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
