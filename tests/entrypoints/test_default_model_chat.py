"""`pagedllm serve` with no model serves the default model (a GGUF without a chat template) and answers
/v1/chat/completions through the shipped Gemma 3 template, as the official `openai` client calls it."""
from __future__ import annotations

import pytest
from serve_helpers import Server

openai = pytest.importorskip("openai")


class _NoModelServer(Server):
    """A Server started with no model argument; constructed with model "" as the placeholder to drop."""

    def _start(self) -> None:
        at = self.args.index("serve") + 1
        if self.args[at] == "":
            del self.args[at]
        super()._start()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    from pagedllm.model_loader.default_model import default_model_path

    try:
        default_model_path()  # assembled here, so the server's start-up is only loading
    except RuntimeError as e:  # the model package is not installed
        pytest.skip(str(e))
    server = _NoModelServer("default-model", "", ["--max-num-seqs", "2"], tmp_path_factory.mktemp("default-model"))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_serve_without_a_model_answers_chat(default_server) -> None:
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    assert "gemma-3-270m" in model
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}],
        max_tokens=4, temperature=0.0,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length") and 0 < reply.usage.completion_tokens <= 4
    # <bos>, the two turn headers and the turn end are counted with the words of the two messages.
    assert reply.usage.prompt_tokens > 8
    log = default_server.log_path.read_text(errors="replace")
    assert "using pagedllm's Gemma 3 template" in log
