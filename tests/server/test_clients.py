"""Drives a running `strata serve` with the official `openai` and `anthropic` packages.

Usage: python test_clients.py BASE_URL API_KEY MODEL_ID

Prints one `PASS name` or `FAIL name: why` line per check and a final
`clients: N passed, M failed`; exits 1 on any failure. The model behind the server may
be random (its text is gibberish): the checks are about the protocol, the shapes, the
counts, and that what is sent reaches the model's prompt.
"""

import json
import sys
import traceback
import urllib.request

import anthropic
import openai

BASE, KEY, MODEL = sys.argv[1], sys.argv[2], sys.argv[3]
oa = openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0, timeout=60)
an = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=60)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_RESULT = "sunny, 21 degrees"

results = []


def check(fn):
    try:
        fn()
        results.append(True)
        print(f"PASS {fn.__name__}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
        results.append(False)
        print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=3)
    return fn


def tokenize(body):
    """The server's /tokenize: the prompt text and token count the model would see."""
    req = urllib.request.Request(
        f"{BASE}/tokenize",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@check
def models_list():
    ids = [m.id for m in oa.models.list()]
    assert ids == [MODEL], ids
    assert oa.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in an.models.list()] == [MODEL]


@check
def chat_non_streaming():
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert 0 < r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The prompt the server counted is the chat template's rendering of these messages.
    t = tokenize({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]})
    assert t["count"] == r.usage.prompt_tokens, (t["count"], r.usage.prompt_tokens)
    assert "Be brief." in t["prompt"] and "Hello!" in t["prompt"]


@check
def chat_streaming_with_usage():
    msgs = [{"role": "user", "content": "Count to five."}]
    whole = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason], finishes
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    # Greedy decoding: the stream says exactly what the whole answer said.
    assert text == whole.choices[0].message.content, (text, whole.choices[0].message.content)
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


@check
def chat_tool_call_round_trip():
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
    ]
    # The fixture's template has no tool section: the schemas go into the system message
    # (x-strata-tools-fallback), which its 256-token context cannot hold, so the model
    # is asked with tool_choice "none"; the earlier call still reaches it, in the content.
    t = tokenize({"messages": messages, "tools": [WEATHER_TOOL]})
    assert t["tools_fallback"] == "system-message" and '"name": "get_weather"' in t["prompt"], t
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=10
    )
    assert raw.headers.get("x-strata-tools-fallback") == "tool-calls", dict(raw.headers)
    r = raw.parse()
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls"), c.finish_reason
    for tc in c.message.tool_calls or []:
        assert tc.type == "function" and tc.id and isinstance(json.loads(tc.function.arguments), dict)
    # The call and the tool's result are rendered into the prompt, and that prompt is
    # what the request was charged for.
    t = tokenize({"messages": messages})
    assert TOOL_RESULT in t["prompt"] and "<arg_value>Paris</arg_value>" in t["prompt"], t["prompt"]
    assert t["prompt"].index("What is the weather") < t["prompt"].index(TOOL_RESULT)
    assert t["count"] == r.usage.prompt_tokens, (t["count"], r.usage.prompt_tokens)
    # Streaming keeps the chunk grammar.
    chunks = list(
        oa.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=10, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


@check
def completions_plain_and_streaming():
    r = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
    parts = list(
        oa.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == r.choices[0].text, (text, r.choices[0].text)
    assert parts[-1].usage.completion_tokens == r.usage.completion_tokens


@check
def messages_non_streaming_with_system():
    m = an.messages.create(
        model=MODEL,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Hi there"}],
        extra_body={"temperature": 0},
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.content and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
    assert 0 < m.usage.output_tokens <= 12 and m.usage.input_tokens > 0
    n = an.messages.count_tokens(model=MODEL, system="You are terse.", messages=[{"role": "user", "content": "Hi there"}])
    assert n.input_tokens == m.usage.input_tokens


@check
def messages_streaming_grammar():
    kwargs = dict(model=MODEL, max_tokens=12, system="You are terse.", messages=[{"role": "user", "content": "Hi"}],
                  extra_body={"temperature": 0})  # greedy (newer SDKs have no temperature argument)
    whole = an.messages.create(**kwargs)
    events = list(an.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    body = [k for k in kinds[1:-2] if k != "ping"]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop", body
    assert set(body[1:-1]) <= {"content_block_delta"}, body
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text, (text, whole.content[0].text)
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # The SDK's own stream helper assembles the same message.
    with an.messages.stream(**kwargs) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole.content[0].text and final.stop_reason == whole.stop_reason


@check
def messages_tool_use_and_result():
    tools = [{"name": "get_weather", "description": "Current weather for a city",
              "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": TOOL_RESULT},
            {"type": "text", "text": "Thanks, and tomorrow?"},
        ]},
    ]
    # tool_choice none: the fixture's 256-token context cannot hold the schemas (see
    # chat_tool_call_round_trip); the earlier call and its result still reach the model.
    none = {"type": "none"}
    m = an.messages.create(
        model=MODEL, max_tokens=10, system="Use tools.", tools=tools, tool_choice=none, messages=messages
    )
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use"), m.stop_reason
    assert all(b.type in ("text", "tool_use") for b in m.content)
    n = an.messages.count_tokens(model=MODEL, system="Use tools.", tools=tools, tool_choice=none, messages=messages)
    assert n.input_tokens == m.usage.input_tokens
    # Same conversation in OpenAI form: the tool result is in the rendered prompt, after
    # the question and before the follow-up.
    t = tokenize({"messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": TOOL_RESULT},
        {"role": "user", "content": "Thanks, and tomorrow?"},
    ]})
    p = t["prompt"]
    assert p.index("Paris?") < p.index(TOOL_RESULT) < p.index("tomorrow?"), p
    assert t["count"] == n.input_tokens, (t["count"], n.input_tokens)
    events = list(
        an.messages.create(model=MODEL, max_tokens=10, tools=tools, tool_choice=none, messages=messages, stream=True)
    )
    assert events[0].type == "message_start" and events[-1].type == "message_stop"


@check
def responses_plain_and_streaming():
    r = oa.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=10, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete"), r.status
    assert isinstance(r.output_text, str) and r.output[0].type == "message"
    assert 0 < r.usage.output_tokens <= 10 and r.usage.input_tokens > 0
    events = list(
        oa.responses.create(
            model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text, (text, r.output_text)
    assert events[-1].response.output_text == r.output_text
    # Input items: a message list with a function call and its output.
    r2 = oa.responses.create(
        model=MODEL,
        max_output_tokens=5,
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}],
        tool_choice="none",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_9", "output": TOOL_RESULT},
        ],
    )
    assert r2.status in ("completed", "incomplete")


@check
def sdk_errors():
    try:
        oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "no-such-model" in e.message
    try:
        an.messages.create(model=MODEL, max_tokens=5, messages=[])
        raise AssertionError("empty messages accepted")
    except anthropic.BadRequestError as e:
        assert e.status_code == 400 and e.body["error"]["type"] == "invalid_request_error"
    bad = openai.OpenAI(base_url=f"{BASE}/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("wrong key accepted")
    except openai.AuthenticationError:
        pass
    bad_an = anthropic.Anthropic(base_url=BASE, api_key="wrong", max_retries=0)
    try:
        bad_an.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("wrong key accepted")
    except anthropic.AuthenticationError as e:
        assert e.body["error"]["type"] == "authentication_error"


@check
def structured_output_json_schema():
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "ok"],
        "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    }
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name?"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
    )
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"name", "ok"} and len(v["name"]) <= 5 and isinstance(v["ok"], bool), v


@check
def logprobs_and_several_choices():
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, seed=1,
        logprobs=True, top_logprobs=2,
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        for t in c.logprobs.content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2, t
    c = oa.completions.create(model=MODEL, prompt="a", max_tokens=3, logprobs=1, extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.tokens) == 3


@check
def forced_tool_call_and_prompt_cache():
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=[tool], tool_choice="required", max_tokens=40
    )
    assert r.choices[0].finish_reason == "tool_calls", r
    assert r.choices[0].message.tool_calls[0].function.name == "now"
    again = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=[tool], tool_choice="required", max_tokens=40
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage
    m = an.messages.create(
        model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Time?"}],
        tools=[{"name": "now", "input_schema": {"type": "object", "properties": {}}}], tool_choice={"type": "any"},
    )
    assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use", m


passed, failed = results.count(True), results.count(False)
print(f"clients: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
