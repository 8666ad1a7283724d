#!/usr/bin/env python3
"""Renders chat templates with transformers' apply_chat_template(..., tokenize=False)
and writes the expected outputs to fixtures/chat_templates/expected.json, which
strata's Rust tests compare byte for byte (CI runs no Python: commit the output).

Two kinds of cases:
  * the official templates in fixtures/chat_templates/templates/ on a set of
    conversations (system, tools, tool calls with nested and non-ASCII arguments,
    tool results, reasoning, multi-part content, generation prompt on/off, thinking
    off, continue_final_message);
  * small feature templates exercising the template environment itself (tojson
    options, how values print, Python string/dict methods, filters, tests, loop
    controls, whitespace control, {% generation %}, strftime_now).

Usage: python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install transformers jinja2
       /tmp/tfvenv/bin/python scripts/make_chat_template_fixtures.py
No torch needed. strftime_now is given a fixed clock (2026-03-14 15:09:26.535897).
"""

import datetime
import json
import pathlib
import sys

import jinja2
import tokenizers
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "chat_templates"
TOKENIZER = ROOT / "fixtures" / "glm5" / "dense-attn" / "tokenizer.json"
FIXED_NOW = datetime.datetime(2026, 3, 14, 15, 9, 26, 535897)
# The same instant as strata's Clock::Fixed(secs, micros) (formatted as UTC there).
FIXED_CLOCK = [1773500966, 535897]


class FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


chat_template_utils.datetime = FixedDatetime

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Météo actuelle — 天气",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches documents",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {"lang": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
                },
                "limit": {"type": "number", "nullable": True},
            },
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]

CALL_ARGS = {"city": "Zürich", "days": 3, "unit": "celsius"}
NESTED_ARGS = {
    "query": "café \"naïve\" <b>&</b>",
    "filters": {"tags": ["a", "ü", 1.5, None, True], "lang": "fr"},
    "limit": 10.0,
}

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour  "},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them.\n"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Again."},
    ],
    "think_in_content": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nvisible"},
        {"role": "user", "content": "Q2"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich for 3 days?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Call the tool.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}},
                {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": NESTED_ARGS}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21°C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "search", "content": "{\"hits\": 0}"},
    ],
    "tool_result_then_answer": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "rain"},
        {"role": "assistant", "content": "It rains.", "reasoning_content": "The tool said rain."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_calls_string_args": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "rain"},
    ],
    "multipart": [
        {"role": "system", "content": [{"type": "text", "text": "Sys part."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part. "}, {"type": "text", "text": "Second part."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Answer."}]},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ],
    "unicode": [
        {"role": "user", "content": "Grüße 👋 — «quotes» and \\ backslash\ttab"},
    ],
}

# (name, template, conversation, options)
TEMPLATES = ["glm-4.6", "glm-4.7", "glm-5", "glm-5.1", "gemma-4", "qwen3", "qwen3-coder", "minimax-m2", "deepseek-v3.1", "gpt-oss",
             "kimi-k2"]
VARIANTS = [
    ("gen", {"add_generation_prompt": True}),
    ("nogen", {"add_generation_prompt": False}),
    ("tools", {"add_generation_prompt": True, "tools": TOOLS}),
    ("nothink", {"add_generation_prompt": True, "tools": TOOLS, "kwargs": {"enable_thinking": False}}),
    ("keep_thinking", {"add_generation_prompt": True, "kwargs": {"clear_thinking": False, "enable_thinking": True}}),
]

FEATURE_CONTEXT = {
    "d": {"zeta": 1, "alpha": [1, 2.5, None, True, False], "name": "météo", "nested": {"q": "<&>'\"", "e": {}}},
    "l": ["b", "a", "c", "a"],
    "s": "  Hello, World. they're here\tnow \n",
    "f": 1e-05,
    "big": 1e16,
    "items": [{"type": "text", "text": "x"}, {"type": "image"}, {"type": "text", "text": "y"}],
    "nums": [3, 1, 2],
    "u": "ÀÉÎõü 😀",
}

FEATURES = {
    "tojson_default": "{{ d | tojson }}",
    "tojson_ensure_ascii": "{{ d | tojson(ensure_ascii=True) }}|{{ u | tojson(true) }}",
    "tojson_indent": "{{ d | tojson(indent=2) }}",
    "tojson_indent_sorted": "{{ d | tojson(indent=4, sort_keys=True) }}",
    "tojson_indent_str": "{{ l | tojson(indent='\\t') }}",
    "tojson_separators": "{{ d | tojson(separators=(',', ':')) }}|{{ d | tojson(indent=1, separators=(';', '= ')) }}",
    "tojson_scalars": "{{ 1.0 | tojson }} {{ f | tojson }} {{ big | tojson }} {{ none | tojson }} {{ 'a\\u0001b' | tojson }}",
    "print_values": "{{ d }}|{{ l }}|{{ true }}|{{ false }}|{{ none }}|{{ 1.0 }}|{{ f }}|{{ big }}|{{ 3 / 2 }}|{{ 4 / 2 }}|{{ 7 // 2 }}|{{ d.missing }}|{{ items[1] }}",
    "print_strings_in_containers": "{{ ['it\\'s', 'say \"hi\"', 'both \\' \"', 'tab\\there', 'é\\u00a0'] }}",
    "string_methods": (
        "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.strip(' \\n') }}|{{ s.split() }}|{{ s.split(',') }}"
        "|{{ s.split(' ', 2) }}|{{ s.rsplit(None, 1) }}|{{ s.replace('l', 'L') }}|{{ s.replace('l', 'L', 1) }}"
        "|{{ s.upper() }}|{{ s.lower() }}|{{ s.title() }}|{{ s.strip().capitalize() }}|{{ s.startswith('  He') }}"
        "|{{ s.endswith(('x', '\\n')) }}|{{ s.find('World') }}|{{ s.count('e') }}|{{ 'a\\nb\\r\\nc'.splitlines() }}"
        "|{{ '-'.join(l) }}|{{ '42'.zfill(5) }}|{{ 'ab'.center(7, '*') }}|{{ 'k=v=w'.partition('=') }}"
        "|{{ u.upper() }}|{{ u.lower() }}|{{ 'prefix_x'.removeprefix('prefix_') }}|{{ 'ab12'.isalnum() }}"
    ),
    "dict_methods": (
        "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ d.keys() | list }}|{{ d.get('zeta') }}"
        "|{{ d.get('nope') }}|{{ d.get('nope', 'dflt') }}|{% for k in d %}{{ k }},{% endfor %}|{{ d | length }}"
    ),
    "filters": (
        "{{ s | trim }}|{{ s | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ nums | join(', ') }}|{{ d.alpha | join }}"
        "|{{ d | string }}|{{ u | length }}|{{ l | first }}|{{ l | last }}|{{ missing | default('dv') }}"
        "|{{ none | default('dv') }}|{{ '' | default('dv', true) }}|{{ '<a & \\'b\\'>' | e }}|{{ '%s-%d' | format('x', 3) }}"
        "|{{ l | unique | list }}|{{ l | reverse | list }}|{{ nums | sort }}|{{ d | dictsort }}|{{ nums | sum }}"
        "|{{ items | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('+') }}|{{ l | length }}"
        "|{{ nums | max }}|{{ 'abc' | upper }}|{{ d.nested | items | list }}"
    ),
    "tests": (
        "{% for v in [s, d, l, 1, 1.5, true, none, missing, items[0]] %}"
        "{{ v is string }}{{ v is mapping }}{{ v is sequence }}{{ v is iterable }}{{ v is number }}"
        "{{ v is integer }}{{ v is float }}{{ v is boolean }}{{ v is none }}{{ v is defined }};{% endfor %}"
    ),
    "loops": (
        "{% for x in nums %}{% if x == 1 %}{% continue %}{% endif %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}"
        "{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{% if x == 2 %}{% break %}{% endif %};{% endfor %}"
        "|{% for x in [] %}x{% else %}empty{% endfor %}|{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}"
    ),
    "whitespace": (
        "<a>\n  {% if true %}\n    inside\n  {% endif %}\n  {# comment #}\n  {%- for x in nums %}\n"
        "  {{ x }}\n  {% endfor -%}\n  <b>\n{%+ if true %}kept{% endif %}\n{{ 'end' }}\n\n"
    ),
    "generation_block": (
        "{% for m in items %}{% generation %}[{{ m.type }}]{% set local = 1 %}{% endgeneration %}\n{% endfor %}"
        "{{ local is defined }}|{%- generation -%}  x  {%- endgeneration -%}  |"
    ),
    "namespace_macro_slices": (
        "{% set ns = namespace(n=0, seen=[]) %}{% for x in nums %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}"
        "|{% macro m(a, b='B') %}<{{ a }}{{ b }}>{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}|{{ l[1:] }}|{{ l[::-1] }}"
        "|{{ s[2:7] }}|{{ 'a' in l }}|{{ 'zeta' in d }}|{{ 'lo' in s }}|{{ 'x' ~ 'y' ~ 1 }}|{{ '=' * 3 }}"
        "|{{ (nums | length) > 2 }}|{{ [1, 2] + [3] }}|{{ -7 // 2 }}|{{ 2 ** 10 }}|{{ 10 % 3 }}"
    ),
    "set_block_and_dict": (
        "{% set block %}inner {{ 1 + 1 }}{% endset %}{{ block }}|{% set x = dict(a=1, b='two') %}{{ x }}"
        "|{{ {'k': 'v', 'n': [1]} }}|{{ x.a }}{{ x['b'] }}"
    ),
    "strftime": "{{ strftime_now('%Y-%m-%d %H:%M:%S') }}|{{ strftime_now('%d %B %Y') }}|{{ strftime_now('%A %j %f') }}",
}


def make_tokenizer(template):
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    return tok


def render(tok, messages, opts):
    kwargs = dict(opts.get("kwargs", {}))
    try:
        return {
            "ok": tok.apply_chat_template(
                messages,
                tools=opts.get("tools"),
                documents=opts.get("documents"),
                add_generation_prompt=opts.get("add_generation_prompt", False),
                continue_final_message=opts.get("continue_final_message", False),
                tokenize=False,
                **kwargs,
            )
        }
    except Exception as e:  # the case records that transformers refuses it
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    cases = []
    for name in TEMPLATES:
        path = OUT / "templates" / f"{name}.jinja"
        if not path.exists():
            print(f"skipping {name}: {path} not found", file=sys.stderr)
            continue
        tok = make_tokenizer(path.read_text())
        for conv_name, messages in CONVERSATIONS.items():
            for var_name, opts in VARIANTS:
                if var_name == "tools" and "tool" not in conv_name and conv_name != "plain":
                    continue
                case = {"name": f"{name}/{conv_name}/{var_name}", "template": f"templates/{name}.jinja",
                        "messages": messages, **{k: v for k, v in opts.items()}}
                case["expected"] = render(tok, messages, opts)
                cases.append(case)
        # Continue the final (assistant) message instead of opening a new one.
        cont = CONVERSATIONS["system_multi_turn"][:3]
        opts = {"continue_final_message": True}
        cases.append({"name": f"{name}/continue_final_message", "template": f"templates/{name}.jinja",
                      "messages": cont, **opts, "expected": render(tok, cont, opts)})
    for fname, source in FEATURES.items():
        tok = make_tokenizer(source)
        messages = [{"role": "user", "content": "x"}]
        opts = {"kwargs": FEATURE_CONTEXT}
        cases.append({"name": f"feature/{fname}", "source": source, "messages": messages, **opts,
                      "expected": render(tok, messages, opts)})
    out = {
        "generated_by": "scripts/make_chat_template_fixtures.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "tokenizers": tokenizers.__version__,
        "python": sys.version.split()[0],
        "special_tokens": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        "fixed_clock": FIXED_CLOCK,
        "cases": cases,
    }
    (OUT / "expected.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    errors = sum("error" in c["expected"] for c in cases)
    print(f"{len(cases)} cases ({errors} refused by transformers) -> {OUT / 'expected.json'}")


if __name__ == "__main__":
    main()
