"""``tiny-llm`` through ``omni-up`` and the official ``openai`` SDK: ``/v1/completions`` and
``/v1/chat/completions``, streamed and not, answer as vLLM's own OpenAI server does for the fields
they share (ids, object, model, ``finish_reason`` length/stop, ``usage``, ``[DONE]``,
``stream_options.include_usage``); a prompt of token ids; the same seed gives the same text;
the stage's ``sampling`` defaults apply to what a request leaves unset; bad sampling values are a
400 naming the field on every route; a client that leaves mid-stream aborts the request inside
vLLM (the pod's running-requests gauge falls back to 0). Chat templates the whole conversation
(``usage`` and the answer those of ``apply_chat_template``); logprobs with alternatives in vLLM's
shapes, streamed and not; ``n`` seeded choices; ``echo`` with the prompt's logprobs. One
``omni-up`` (``tiny_llm_server`` in conftest, shared with test_vllm_pd_split.py), streaming
(``async_chunk``, a chunk per token), its stage's default temperature 0 (greedy) and
``chat_template`` on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omni_mesh.engines.vllm.tiny_models import ensure_tiny_model
from tests.engines.vllm.servers import MODEL, Server
from tests.procs import wait_until
from tests.sidecar.topology import post_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def server(tiny_llm_server: Server) -> Server:
    return tiny_llm_server


def test_completion_fields_usage_and_length(server: Server) -> None:
    out = server.client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=12)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.created > 0 and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage is not None
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    # Sampled (temperature 1): the same seed gives the same text, other seeds other texts.
    choice = server.client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=12, temperature=1.0, seed=3
    ).choices[0]
    again = server.client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=12, temperature=1.0, seed=3
    )
    assert again.choices[0].text == choice.text
    other = [
        server.client.completions.create(
            model=MODEL, prompt="once upon a time", max_tokens=12, temperature=1.0, seed=s
        )
        .choices[0]
        .text
        for s in (4, 5)
    ]
    assert any(t != choice.text for t in other)


def test_stage_defaults_apply_to_what_the_request_leaves_unset(server: Server) -> None:
    # The stage's default temperature is 0 (greedy): a request that sets only top_p or seed
    # gets the same text whatever its seed; max_tokens defaults to the stage's 16.
    texts = {
        server.client.completions.create(model=MODEL, prompt="the stage default", top_p=0.9, seed=s)
        .choices[0]
        .text
        for s in (1, 2, 3)
    }
    assert len(texts) == 1
    out = server.client.completions.create(model=MODEL, prompt="the stage default", seed=9)
    assert out.usage is not None and out.usage.completion_tokens == 16


def test_token_id_prompt_stop_and_logprobs(server: Server) -> None:
    by_ids = server.client.completions.create(
        model=MODEL, prompt=[5, 17, 300, 41, 99], max_tokens=6, logprobs=0
    )
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 5
    logprobs = by_ids.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in logprobs.token_logprobs)
    greedy = server.client.completions.create(model=MODEL, prompt="stop here", max_tokens=16)
    text = greedy.choices[0].text
    stop = text[len(text) // 2 :][:3].strip() or text[-1]
    stopped = server.client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=16, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)


def test_streamed_completion_token_by_token_with_usage(server: Server) -> None:
    whole = server.client.completions.create(model=MODEL, prompt="stream me", max_tokens=10)
    events = list(
        server.client.completions.create(
            model=MODEL,
            prompt="stream me",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [e.choices[0].text for e in events if e.choices and e.choices[0].text]
    assert len(texts) >= 5  # a chunk per token (tokens of a few bytes may merge)
    assert "".join(texts) == whole.choices[0].text
    assert all(e.object == "text_completion" and e.id == events[0].id for e in events)
    finals = [e.choices[0].finish_reason for e in events if e.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert events[-1].choices == [] and events[-1].usage is not None
    assert events[-1].usage.completion_tokens == 10


def test_chat_streamed_and_not(server: Server) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    out = server.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        seed=1,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 8
    stream = server.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(stream)
    deltas = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta]
    assert events[0].choices[0].delta.role == "assistant"
    assert len([d for d in deltas if d]) >= 4
    assert "".join(d or "" for d in deltas) == out.choices[0].message.content
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].usage is not None and events[-1].usage.total_tokens == out.usage.total_tokens


def _templated(vllm_env: dict[str, str], messages: list[dict[str, str]]) -> list[int]:
    """``messages`` through the tiny model's own chat template (as vLLM's server applies it)."""
    from transformers import AutoTokenizer

    models = Path(vllm_env["XDG_CACHE_HOME"]) / "omni-mesh" / "models"
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny-llama-text", models))
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]


def test_chat_templates_the_whole_conversation(server: Server, vllm_env: dict[str, str]) -> None:
    parts = [{"type": "text", "text": "tell"}, {"type": "text", "text": "more"}]
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": parts},
    ]
    plain = [{**m, "content": "tell\nmore"} if i == 3 else m for i, m in enumerate(conversation)]
    whole = server.client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        max_tokens=8,  # type: ignore[arg-type]
    )
    last = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell more"}], max_tokens=8
    )
    ids = _templated(vllm_env, plain)
    assert whole.usage is not None and last.usage is not None
    assert whole.usage.prompt_tokens == len(ids)
    assert last.usage.prompt_tokens == len(
        _templated(vllm_env, [{"role": "user", "content": "tell more"}])
    )
    assert whole.usage.prompt_tokens > last.usage.prompt_tokens
    # The answer is the model's greedy continuation of exactly the templated conversation.
    same = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    assert whole.choices[0].message.content == same.choices[0].text
    status, raw = post_json(
        f"{server.url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "x"}, *conversation[1:2]]},
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages", raw[:300]


def test_chat_logprobs_with_alternatives_streamed_and_not(server: Server) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
    }
    out = server.client.chat.completions.create(**ask)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 5
    for entry in logprobs.content:
        top = entry.top_logprobs
        assert len(top) == 3 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        # Greedy: the sampled token is the likeliest, first in vLLM's order; then descending.
        assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob)
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
    events = list(server.client.chat.completions.create(**ask, stream=True))
    streamed = [
        c.model_dump() for e in events if e.choices and e.choices[0].logprobs
        for c in e.choices[0].logprobs.content or []
    ]  # fmt: skip
    assert streamed == [c.model_dump() for c in logprobs.content]
    status, raw = post_json(
        f"{server.url}/v1/chat/completions", {**ask, "logprobs": False, "top_logprobs": 2}
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == "top_logprobs"


def test_completion_logprobs_with_alternatives_streamed_and_not(server: Server) -> None:
    ask: dict[str, Any] = {
        "model": MODEL, "prompt": "once upon", "max_tokens": 6, "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    out = server.client.completions.create(**ask)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs or [], lp.top_logprobs, strict=True):
        assert top[token] == value and 1 <= len(top) <= 3  # the token and the top 2
    events = list(server.client.completions.create(**ask, stream=True))
    parts = [e.choices[0].logprobs for e in events if e.choices and e.choices[0].logprobs]
    assert [t for p in parts if p for t in p.tokens or []] == lp.tokens
    assert [o for p in parts if p for o in p.text_offset or []] == lp.text_offset


def test_n_choices_seeded_streamed_and_not(server: Server) -> None:
    ask: dict[str, Any] = {
        "model": MODEL, "prompt": "a tale", "max_tokens": 6, "temperature": 1.0, "seed": 11,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    out = server.client.completions.create(**ask, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1  # each choice its own seed
    one = server.client.completions.create(**ask)  # choice 0 is the seed's own answer
    assert out.usage is not None and one.usage is not None
    assert out.usage.prompt_tokens == one.usage.prompt_tokens
    assert out.usage.completion_tokens == 18 and texts[0] == one.choices[0].text
    again = server.client.completions.create(**ask, n=3)
    assert [c.text for c in again.choices] == texts
    chat: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "a tale"}], "max_tokens": 5,
        "temperature": 1.0, "seed": 11, "n": 2,
    }  # fmt: skip
    whole = server.client.chat.completions.create(**chat)
    events = list(server.client.chat.completions.create(**chat, stream=True))
    got = {0: "", 1: ""}
    for event in events:
        for choice in event.choices:
            got[choice.index] += choice.delta.content or ""
    assert got == {c.index: c.message.content for c in whole.choices}
    ends = [
        (e.choices[0].index, e.choices[0].finish_reason)
        for e in events
        if e.choices[0].finish_reason
    ]
    assert sorted(ends) == [(c.index, c.finish_reason) for c in whole.choices]


def test_echo_with_prompt_logprobs(server: Server, vllm_env: dict[str, str]) -> None:
    out = server.client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=4, echo=True, logprobs=1
    )
    choice, usage = out.choices[0], out.usage
    assert choice.text.startswith("once upon") and usage is not None
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    prompt_tokens = (lp.tokens or [])[: usage.prompt_tokens]
    assert "".join(prompt_tokens) == "once upon" and (lp.text_offset or [None])[0] == 0
    ids = [5, 17, 300, 41]
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True)
    from transformers import AutoTokenizer

    models = Path(vllm_env["XDG_CACHE_HOME"]) / "omni-mesh" / "models"
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny-llama-text", models))
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))
    assert len(by_ids.choices[0].text) > len(tokenizer.decode(ids))


_USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("chat/completions", {"messages": _USER, "top_k": -2}, "top_k"),
        ("chat/completions", {"messages": _USER, "repetition_penalty": 0}, "repetition_penalty"),
        (
            "run",
            {"stage_id": 0, "stage_input": {"prompt": "x"}, "sampling_params": {"top_p": 0}},
            "top_p",
        ),
    ],
)
def test_bad_sampling_is_a_400_naming_the_field(
    server: Server, route: str, body: dict[str, object], field: str
) -> None:
    if route != "run":
        body = {"model": MODEL, **body}
    status, raw = post_json(f"{server.url}/v1/{route}", body)
    assert status == 400, raw[:500]
    assert field in json.loads(raw)["error"]["message"]


def test_a_client_that_leaves_mid_stream_aborts_the_vllm_request(server: Server) -> None:
    stream = server.client.completions.create(
        model=MODEL,
        prompt="a long story",
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},  # vLLM's extension: no early end
    )
    got = 0
    for event in stream:
        got += bool(event.choices and event.choices[0].text)
        if got >= 3:
            break
    wait_until(lambda: server.running() == 1, 10, interval=0.1)  # still generating
    stream.close()  # the connection goes away
    # 2,000 tokens take several seconds here; the engine reports its batch every 0.5 s.
    wait_until(lambda: server.running() == 0, 2.5, interval=0.05)
    logs = Path(server.proc.wait_for_output(r"logs\s+(\S+)")[1])
    wait_until(lambda: "vLLM request aborted" in (logs / "stage0-llm-0.log").read_text(), 5)
