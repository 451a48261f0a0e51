"""The official `openai` Python client against a running strix server.

Usage: python openai_client.py BASE_URL API_KEY MODEL
Run by tests/openai_python.rs, which starts the server on the tiny fixture model (random
weights: the text is gibberish, but greedy decoding is deterministic). Exits non-zero on
the first failed check. Needs `jsonschema` beside `openai` (pydantic comes with openai).
"""

import json
import sys
from typing import Literal

import jsonschema
import openai
import pydantic

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
checks = 0


def check(condition, what):
    global checks
    if not condition:
        raise AssertionError(what)
    checks += 1


def extra(obj, name):
    """A field outside OpenAI's schema (reasoning_content), kept by the client's models."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


messages = [{"role": "user", "content": "Why is the sky blue?"}]

# Models.
ids = [m.id for m in client.models.list().data]
check(ids == [model], f"models: {ids}")

# Chat, whole.
whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
choice = whole.choices[0]
check(choice.message.role == "assistant", "role")
check(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
check(whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 0, "usage")
check(whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens, "total")
reasoning = extra(choice.message, "reasoning_content") or ""
content = choice.message.content or ""

# Chat, streamed: the same text, split the same way, then a usage chunk.
chunks = list(
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
)
streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
streamed_reasoning = "".join(extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
check(streamed_content == content, f"streamed content {streamed_content!r} != {content!r}")
check(streamed_reasoning == reasoning, f"streamed reasoning {streamed_reasoning!r} != {reasoning!r}")
finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
check(finishes == [choice.finish_reason], f"stream finish {finishes}")
check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens, "usage chunk")

# Thinking off through chat_template_kwargs: the answer is content, not reasoning.
direct = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0,
    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
)
check(not extra(direct.choices[0].message, "reasoning_content"), "no reasoning when thinking is off")
check(direct.usage.prompt_tokens > whole.usage.prompt_tokens, "the empty think block is in the prompt")

# Completions, whole and streamed.
prompt = "The capital of France is"
comp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
text = comp.choices[0].text
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
check(streamed == text, f"streamed completion {streamed!r} != {text!r}")

# Stop strings: the text ends before the first occurrence, which is never emitted.
long = client.completions.create(
    model=model, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
).choices[0].text
stop = long[8:10]
stopped = client.completions.create(
    model=model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
).choices[0]
check(stopped.text == long[: long.index(stop)], f"stop {stop!r}: {stopped.text!r}")
check(stopped.finish_reason == "stop", "stop finish")

# Seeds.
def sampled(seed):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=1.0, seed=seed
    ).choices[0].message


first, again = sampled(11), sampled(11)
check((first.content, extra(first, "reasoning_content")) == (again.content, extra(again, "reasoning_content")), "seed")

# Logprobs.
lp = client.chat.completions.create(
    model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
    extra_body={"ignore_eos": True},
).choices[0].logprobs.content
check(len(lp) == 6, f"{len(lp)} logprobs")
check(all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in lp), "top logprobs")
comp_lp = client.completions.create(
    model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
).choices[0].logprobs
check(len(comp_lp.tokens) == 4 and len(comp_lp.token_logprobs) == 4, "completion logprobs")

# Tools are accepted and reach the template (the random model does not call them).
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
with_tools = client.chat.completions.create(model=model, messages=messages, max_tokens=1, tools=tools)
check(with_tools.usage.prompt_tokens > whole.usage.prompt_tokens, "tools in the prompt")

# Structured output. The fixture's weights are random: only the constraint makes its output
# valid, so every check below fails without it.
record = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                  "required": ["name"], "additionalProperties": False},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}},
    },
    "required": ["colour", "count", "owner", "tags"],
    "additionalProperties": False,
}
for seed in range(4):
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=300, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": record, "strict": True}},
    ).choices[0]
    check(r.finish_reason == "stop", f"json_schema finish {r.finish_reason}: {r.message.content!r}")
    jsonschema.validate(json.loads(r.message.content), record)
    checks += 1
obj = client.chat.completions.create(
    model=model, messages=messages, max_tokens=400, temperature=0.5, seed=1, response_format={"type": "json_object"}
).choices[0]
if obj.finish_reason == "stop":
    check(isinstance(json.loads(obj.message.content), dict), f"json_object: {obj.message.content!r}")


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = pydantic.Field(ge=1, le=7)
    windy: bool


for seed in range(3):
    parsed = client.beta.chat.completions.parse(
        model=model, messages=messages, max_tokens=200, temperature=1.0, seed=seed, response_format=Weather
    ).choices[0].message
    check(isinstance(parsed.parsed, Weather) and 1 <= parsed.parsed.days <= 7, f"parse: {parsed!r}")

# Forced tool calls: a named function and "required"; the arguments follow its schema.
weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
forced_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=300, temperature=1.0, seed=3, tools=forced_tools,
        tool_choice=choice,
    ).choices[0]
    check(r.finish_reason == "tool_calls" and r.message.tool_calls, f"forced call {choice}: {r}")
    for call in r.message.tool_calls:
        check(call.function.name == "get_weather", f"called {call.function.name}")
        jsonschema.validate(json.loads(call.function.arguments), weather)
        checks += 1

# logit_bias +100 on one token forces it at every step (the fixture's id 74 is a one-byte token).
biased = client.completions.create(
    model=model, prompt=prompt, max_tokens=5, temperature=1.0, seed=4, logit_bias={"74": 100},
    extra_body={"ignore_eos": True},
).choices[0].text
check(len(biased) == 5 and len(set(biased)) == 1, f"logit_bias: {biased!r}")

# A schema llguidance cannot compile is a 400 naming response_format.
try:
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
    )
    check(False, "a bad schema was accepted")
except openai.BadRequestError as e:
    check(e.param == "response_format" and "cannot compile the JSON schema" in str(e), f"bad schema: {e}")

# Errors surface as the client's exceptions, with the server's message.
try:
    client.chat.completions.create(model=model, messages=messages, temperature="hot")
    check(False, "a bad temperature was accepted")
except openai.BadRequestError as e:
    check("temperature" in str(e), f"bad request message: {e}")
try:
    client.chat.completions.create(model=model, messages=messages, n=2)
    check(False, "n=2 was accepted")
except openai.BadRequestError:
    checks += 1

# Auth.
bad = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
try:
    bad.models.list()
    check(False, "a wrong key was accepted")
except openai.AuthenticationError:
    checks += 1

print(f"openai {openai.__version__}: {checks} checks passed")
