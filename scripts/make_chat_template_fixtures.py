#!/usr/bin/env python3
"""Writes tests/fixtures/chat_templates/cases.json: chat templates that use
what model templates use (block tags on lines of their own, macros,
namespaces, slices, Python string methods, loop controls and neighbours,
transformers' {% generation %} tags and tojson, lengths of undefined
values) and conversations, each with the text transformers renders (its
own jinja2 environment, `apply_chat_template`'s), which
tests/chat_templates.rs holds wgspark's rendering to.

  python scripts/make_chat_template_fixtures.py

Needs transformers (and jinja2).
"""
import json
from pathlib import Path

from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = Path(__file__).resolve().parent.parent

# Block tags on lines of their own, indented: jinja2's trim_blocks and
# lstrip_blocks (transformers sets both) decide the whitespace.
BLOCKS = """{%- set ns = namespace(last_user=-1) %}
{% for m in messages %}
    {% if m.role == 'user' %}
        {% set ns.last_user = loop.index0 %}
    {% endif %}
{% endfor %}
{% macro turn(role, text) %}
<|{{ role }}|>
{{ text }}<|end|>
{% endmacro %}
{% for m in messages %}
    {% if m.role == 'system' %}
{{ turn('system', m.content | trim) }}
    {% elif m.role == 'assistant' %}
        {% set content = m.content %}
        {% if '</think>' in content %}
            {% set content = content.split('</think>')[-1].lstrip('\\n') %}
        {% endif %}
        {% if loop.index0 > ns.last_user %}
{{ turn('assistant', m.content) }}
        {% else %}
{{ turn('assistant', content) }}
        {% endif %}
    {% else %}
{{ turn(m.role, m.content) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

# Reversed slices, string tests and the first and last of a loop, with
# explicit whitespace control (as Qwen3's template writes it).
SLICES = """{{- bos_token }}
{%- for message in messages[::-1] %}
    {%- if loop.first %}{{- 'last: ' + message.role + '\\n' }}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string and message.content.startswith('!') %}
        {{- '[command] ' + message.content[1:] | upper }}
    {%- else %}
        {{- '<' + message.role + '>' + message.content.strip() + '</' + message.role + '>' }}
    {%- endif %}
    {%- if not loop.last %}{{- '\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '\\n<assistant>' }}{%- endif %}
{{- eos_token if not add_generation_prompt else '' }}"""

# transformers' generation tags (they mark the assistant's tokens and write
# nothing themselves), with and without whitespace control.
GENERATION = """{% for message in messages %}
{% if message['role'] != 'assistant' %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{% else %}
{{ '<|im_start|>assistant\\n' }}
{%- generation -%}
{{ message['content'] + '<|im_end|>' }}
{%- endgeneration %}
{% generation %}{{ '\\n' }}{% endgeneration %}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

# Loop controls (transformers enables jinja2's) and a loop's neighbours.
LOOPS = """{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% if loop.previtem is defined %}(after {{ loop.previtem.role }}){% endif %}
  [{{ m.role | upper }}] {{ m.content | trim }}{% if loop.nextitem is defined %} ...{% endif %}

  {% if m.content == 'Bye' %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}
"""

# transformers' tojson (json.dumps, ensure_ascii=False): its separators,
# its indentation, no HTML escaping, keys in their order.
TOJSON = """{%- for m in messages %}
{{- {"role": m.role, "content": m.content, "turn": loop.index, "last": loop.last, "none": none} | tojson }}
{{- '\n' }}
{%- endfor %}
{{- [1, 2.5, '<b>"quoted"</b>', {"z": [], "a": {}}] | tojson(indent=2) }}"""

# Counting what is not there: jinja2's undefined has length 0 (templates
# test `tools|length` and `message.tool_calls|length` with neither passed).
UNDEFINED = """{%- if tools is not none and tools|length > 0 %}<|tools|>{{ tools|count }}
{% endif %}
{%- for m in messages %}
<|{{ m.role }}|>{{ m.content }}
    {%- if m.tool_calls|length > 0 %}<|calls|>{% endif %}
{%- endfor %}"""

TEMPLATES = {"blocks": BLOCKS, "slices": SLICES, "generation": GENERATION, "loops": LOOPS, "tojson": TOJSON,
             "undefined": UNDEFINED}

CONVERSATIONS = [
    ([("user", "Hi there")], True),
    ([("system", "  Be brief.  "), ("user", "What is 2+2?")], True),
    ([("user", "Hi"), ("assistant", "<think>\nhmm\n</think>\n\nHello!"), ("user", "!stop"), ("assistant", "Bye")], False),
    ([("user", "Bye"), ("assistant", "  spaced  "), ("user", "again")], True),
    ([("user", 'a <tag> & "quotes"\nand a line, é')], True),
]


def main():
    cases = []
    for name, source in TEMPLATES.items():
        template = _compile_jinja_template(source)
        renders = []
        for messages, add_generation_prompt in CONVERSATIONS:
            messages = [{"role": r, "content": c} for r, c in messages]
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token="<s>", eos_token="</s>")
            renders.append(dict(messages=messages, add_generation_prompt=add_generation_prompt, text=text))
        cases.append(dict(name=name, template=source, bos_token="<s>", eos_token="</s>", renders=renders))
    out = ROOT / "tests/fixtures/chat_templates/cases.json"
    out.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"{out}: {len(cases)} templates, {sum(len(c['renders']) for c in cases)} renderings")


if __name__ == "__main__":
    main()
