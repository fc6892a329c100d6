"""Session fixtures: the real `pagedllm serve` processes (see serve_helpers) and OpenAI clients for them."""
from __future__ import annotations

import pytest
from serve_helpers import API_KEY, ENV_API_KEY, Server, make_model


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    mistral = make_model("mistral", root / "mistral")
    qwen = make_model("qwen3", root / "qwen3", tie=True)
    launched = {
        # Asynchronous scheduling, as on a GPU: the core sends each step's outputs before the next
        # step's sampling is launched (EngineCore.emit_outputs), under every test of this server.
        "completions": Server(
            "completions", mistral,
            ["--served-model-name", "tiny-mistral", "alias", "--max-n", "8",
             "--max-request-body-bytes", "65536", "--max-header-bytes", "8192", "--async-scheduling",
             "--trust-request-chat-template"],
            root, api_key=API_KEY, env={"PAGEDLLM_API_KEY": ENV_API_KEY},
        ),
        # Small limits so overload is easy to reach; test_openai_engine_failure kills its engine
        # (and it is restarted if a later test needs it).
        "chat": Server("chat", qwen, ["--served-model-name", "tiny-qwen", "--max-num-seqs", "2",
                                      "--max-waiting-requests", "2"], root),
        # Short read timeouts and a small connection limit, for test_server_lifecycle's slow clients.
        "limits": Server("limits", qwen, ["--served-model-name", "tiny-qwen", "--header-read-timeout", "1",
                                          "--body-read-timeout", "1", "--timeout-keep-alive", "1",
                                          "--limit-concurrency", "4", "--max-header-bytes", "8192"], root),
    }
    yield launched
    for s in launched.values():
        s.stop()


@pytest.fixture(scope="session")
def completions_server(servers) -> Server:
    return servers["completions"].wait_ready()


@pytest.fixture(scope="session")
def limits_server(servers) -> Server:
    return servers["limits"].wait_ready()


@pytest.fixture
def chat_server(servers) -> Server:
    return servers["chat"].wait_ready()


@pytest.fixture(scope="session")
def client(completions_server):
    import openai

    return openai.OpenAI(base_url=f"{completions_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def chat_client(chat_server):
    import openai

    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
