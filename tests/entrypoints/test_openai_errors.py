"""The server's error table: every error is OpenAI-shaped, names what is wrong, and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import API_KEY, ENV_API_KEY

MODEL = "tiny-mistral"


def _post(server, path: str, body=None, content: bytes | None = None, headers: dict | None = None) -> httpx.Response:
    h = dict(server.headers) if headers is None else headers
    if content is not None:
        h["content-type"] = "application/json"
        return httpx.post(f"{server.url}{path}", content=content, headers=h, timeout=60)
    return httpx.post(f"{server.url}{path}", json=body, headers=h, timeout=60)


def _assert_error(r: httpx.Response, status: int, param: str | None = "?", contains: tuple[str, ...] = ()) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "?":
        assert err["param"] == param, err
    for s in contains:
        assert s in err["message"], err["message"]
    return err


def _still_serving(server) -> None:
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_malformed_and_non_object_bodies(completions_server):
    for content in (b"{not json", b"", b"[1, 2]", b'"a string"', b"42", b"\xff\xfe"):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            _assert_error(_post(completions_server, path, content=content), 400)
    # Wrong types and missing fields are 400s naming the field.
    _assert_error(_post(completions_server, "/v1/completions", {"model": MODEL}), 400, "prompt")
    _assert_error(_post(completions_server, "/v1/completions", {"prompt": "x", "n": "many"}), 400, "n")
    _assert_error(_post(completions_server, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, "temperature")
    _assert_error(_post(completions_server, "/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    _still_serving(completions_server)


def test_unknown_model_is_404(client, completions_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" and "no-such-model" in e.value.body["message"]
    err = _assert_error(_post(completions_server, "/v1/chat/completions",
                              {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}), 404, "model")
    assert err["code"] == "model_not_found"
    _assert_error(httpx.get(f"{completions_server.url}/no/such/route", headers=completions_server.headers), 404)


def _num_tokens(server, text: str) -> int:
    return len(_post(server, "/tokenize", {"prompt": text}).json()["tokens"])


def test_context_length_errors_name_both_numbers(client, completions_server):
    long_prompt = "hello " * 300
    n_long = _num_tokens(completions_server, long_prompt)
    assert n_long > 256
    err = _assert_error(_post(completions_server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1}), 400,
                        "prompt", contains=("256", str(n_long)))
    assert err["code"] == "context_length_exceeded"
    mid = "hello " * 100
    n_mid = _num_tokens(completions_server, mid)
    err = _assert_error(_post(completions_server, "/v1/completions", {"prompt": mid, "max_tokens": 200}), 400,
                        "max_tokens", contains=("256", str(n_mid + 200), str(n_mid), "200"))
    # Token-id prompts are checked the same way.
    _assert_error(_post(completions_server, "/v1/completions", {"prompt": [5] * 256, "max_tokens": 1}), 400, "prompt",
                  contains=("256",))
    # The default max_tokens of /v1/completions (16) counts too.
    near = "hello " * 120
    n_near = _num_tokens(completions_server, near)
    assert 240 < n_near < 256
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=near)
    assert "256" in e.value.body["message"] and str(n_near + 16) in e.value.body["message"]
    _still_serving(completions_server)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -7),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 10),  # more than max_tokens (5)
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
        ("stop_token_ids", [32000]),
        ("logit_bias", {"5": 500.0}),
        ("logit_bias", {"32000": 1.0}),
        ("logit_bias", {"not-a-token": 1.0}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [40000]),
        ("seed", 1 << 70),
        ("top_k", 1 << 64),
    ],
)
def test_invalid_sampling_field_names_the_field(completions_server, field, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, field: value}
    err = _assert_error(_post(completions_server, "/v1/completions", body), 400, field)
    assert field in err["message"]


def test_logit_bias_outside_vocabulary_via_openai_client(client, completions_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"99999": 5})
    assert e.value.body["param"] == "logit_bias" and "99999" in e.value.body["message"]
    assert "32000" in e.value.body["message"]


def test_n_over_max_n(client, completions_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=9)
    assert e.value.body["param"] == "n" and "8" in e.value.body["message"]
    assert len(client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=8).choices) == 8


def test_unsupported_fields(completions_server):
    _assert_error(_post(completions_server, "/v1/completions", {"prompt": "x", "suffix": "y"}), 400, "suffix")
    _assert_error(_post(completions_server, "/v1/completions", {"prompt": "x", "best_of": 3}), 400, "best_of")
    _assert_error(_post(completions_server, "/v1/completions", {"prompt": []}), 400, "prompt")
    # Mistral's tokenizer has no chat template: a 400 on messages, not a crash.
    _assert_error(_post(completions_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                  400, "messages")


ROUTES = [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/no/such/route"),
]


def test_api_key_required_everywhere_but_health(completions_server):
    url = completions_server.url
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic c2stcGFnZWQ="},
                        {"Authorization": completions_server.headers["Authorization"] + "x"}):
            r = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "x"})
            err = _assert_error(r, 401)
            assert err["type"] == "authentication_error"
    assert httpx.get(f"{url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_the_key_in_the_environment_is_accepted_beside_the_flags(completions_server):
    # `pagedllm serve` adds PAGEDLLM_API_KEY (read by pagedllm.envs in the server's process) to --api-key.
    for key in (ENV_API_KEY, API_KEY):
        r = httpx.get(f"{completions_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.get(f"{completions_server.url}/v1/models", headers={"Authorization": f"Bearer {ENV_API_KEY}x"}, timeout=30)
    _assert_error(r, 401)


def test_body_and_header_size_limits(completions_server):
    big = b'{"prompt": "' + b"a" * 70000 + b'"}'
    _assert_error(_post(completions_server, "/v1/completions", content=big), 413)
    # Without Content-Length (chunked upload) the limit holds too.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 5000
        yield b'"}'

    r = httpx.post(f"{completions_server.url}/v1/completions", content=chunks(),
                   headers={**completions_server.headers, "content-type": "application/json"}, timeout=60)
    _assert_error(r, 413)
    headers = {**completions_server.headers, "X-Padding": "p" * 10000}
    _assert_error(httpx.get(f"{completions_server.url}/v1/models", headers=headers), 431)
    _still_serving(completions_server)
