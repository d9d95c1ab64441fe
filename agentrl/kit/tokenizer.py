"""The local tokenizer: a Qwen2-style byte-level BPE trained here, with a Qwen2.5 tool-calling chat template.

There is no model hub on our machines, so tests and the demo train their own tokenizer on text that
looks like our environments' transcripts and load it through the code path a real Qwen2.5 checkpoint
takes (`AutoTokenizer.from_pretrained` -> `Qwen2Tokenizer`). Three pieces, each replaceable:

- `synthetic_transcripts(seed, n)`: procedurally generated tool-use conversations (system prompt with
  tool schemas, arithmetic / word / bash / SQL / coding problems, `<tool_call>` turns, tool results,
  `submit`). A function of a seed so the corpus is reproducible; `train_tokenizer` takes any iterable of
  `Transcript`, so real environment rollouts can replace it later.
- `CHAT_TEMPLATE`: Qwen2.5's Hermes-format template (tools as JSON inside `<tools></tools>` in the system
  turn, `<tool_call>\\n{json}\\n</tool_call>` in assistant turns, tool results as a `user` turn wrapped in
  `<tool_response>`), simplified but faithful. It is append-only at every assistant boundary (see
  `CHAT_TEMPLATE`'s comment for the one place it is not, which it shares with Qwen2.5).
- `train_tokenizer(...)`: BPE over all 256 bytes with Qwen2's normalizer (NFC), pre-tokenizer regex and
  byte-level decoder, then the special tokens appended after the learned vocabulary as Qwen does.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

# Qwen2's pre-tokenizer regex (transformers' `tokenization_qwen2.PRETOKENIZE_REGEX`). It must be the same
# string: `AutoTokenizer` rebuilds a `Qwen2Tokenizer`'s pipeline from this regex, not from tokenizer.json.
# Digits split one by one (`\p{N}`), which keeps arithmetic learnable.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: never produced by encoding user text, dropped by `skip_special_tokens`.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Tool markup: single ids (so a parser can find them by id) but not special, as in Qwen2.5, so
# `decode(..., skip_special_tokens=True)` keeps them and a tool-call parser still sees them.
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5-Instruct's template with three deliberate differences: the default system prompt is neutral,
# `tool_call.arguments` may be a JSON string (inserted as is, as Qwen3 does) or a mapping (`tojson`), and
# an empty `messages` renders nothing instead of failing on `messages[0]`.
#
# Append-only: for any k where messages[k] is an assistant turn, render(messages[:k], generation prompt)
# is a prefix of render(messages[:k+1]), and every assistant turn ends with "<|im_end|>\n". Like Qwen2.5,
# consecutive `tool` messages share one `user` turn, so a rendering that *ends* on a tool message followed
# by another tool message is not a prefix of the longer one; the masker only cuts at assistant boundaries.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM_PROMPT + "' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- elif messages %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Transcript(NamedTuple):
    """One conversation in the chat-template format: what `apply_chat_template` takes."""

    messages: list[dict[str, Any]]
    """Chat messages (`role`, `content`, optional `tool_calls` / `name`), in order."""
    tools: list[dict[str, Any]] | None
    """OpenAI-style tool schemas offered in the system turn, or None for a plain chat."""


class TokenizerRecipe(NamedTuple):
    """Everything that determines the trained tokenizer's files (hashed into the model kit's recipe)."""

    vocab_size: int = 3072
    """Upper bound on the learned BPE vocabulary, 256 byte symbols included; the 7 special/tool tokens come
    on top. Training stops earlier once every pre-token is a single token: the default corpus gives 2536."""
    corpus_seed: int = 0
    """Seed of `synthetic_transcripts`."""
    corpus_transcripts: int = 3000
    """How many synthetic transcripts to train on (about 1 KiB of text each)."""
    min_frequency: int = 2
    """A pair seen fewer times than this is never merged."""


# ---------------------------------------------------------------------------------------------------------
# The synthetic corpus


def _tool(name: str, description: str, params: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """An OpenAI-style function schema; `params` maps name -> (json type, description), all required."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                "required": list(params),
            },
        },
    }


PYTHON_TOOL = _tool(
    "python",
    "Run Python 3 code in the sandbox and return its stdout and stderr.",
    {"code": ("string", "The code.")},
)
BASH_TOOL = _tool(
    "bash",
    "Run a bash command in the workspace and return its output.",
    {"command": ("string", "The command.")},
)
SQL_TOOL = _tool(
    "sql",
    "Run a read-only SQL query against the task's SQLite database.",
    {"query": ("string", "The query.")},
)
SUBMIT_TOOL = _tool(
    "submit",
    "Submit the final answer. The episode ends after this call.",
    {"answer": ("number", "The answer.")},
)

_NAMES = [
    "Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar",
    "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "José", "Zoë", "Łukasz", "Søren", "Mei", "Ngozi",
    "Priya", "Amara", "Kenji", "Olga", "Ravi", "Fatima",
]  # fmt: skip
_ITEMS = [
    "apples", "books", "coins", "marbles", "tickets", "stamps", "pencils", "cookies", "oranges", "bottles",
    "cards", "shells", "stickers", "candies", "boxes", "eggs", "flowers", "chairs", "toys", "pens",
]  # fmt: skip
_UNITS = [
    ("km", "hours", "km per hour"),
    ("liters", "minutes", "liters per minute"),
    ("pages", "days", "pages per day"),
]
_WORD_TEXT = (
    "the a an of to in and for with on at by from is are was were be been has have had do does did not "
    "this that these those it its we you they he she them our your their there here what which who when "
    "where why how all each every some any many more most less few first last next then now after before "
    "because so if else but or also only just still again already result answer value number total sum "
    "count list file line lines word words output input error test tests function code program script data "
    "table row rows column columns query database string integer float error value true false check run "
    "compute calculate print return submit call tool tools step steps problem task question solution correct "
    "wrong expected got found missing empty invalid type name names key keys item items size length order "
    "sort sorted largest smallest average mean median maximum minimum even odd prime divisible remainder "
    "product difference quotient square root power percent half double triple twice times per each price cost "
    "pay paid buy buys bought sell sells sold give gives gave take takes took left remaining more fewer "
    "shop store market school class student students teacher book train car bus trip distance speed time "
    "hour hours minute minutes day days week weeks month months year years money dollars euros cents "
    "workspace directory folder path command shell process memory limit timeout sandbox container verify "
    "let me think first look see read write open close start stop try use using used need needs should "
    "would could will can must may might know knows make makes made get gets set sets keep keeps found find"
)
_WORDS = _WORD_TEXT.split()
_SYSTEMS = [
    "You are a careful assistant that solves tasks with tools. Check your work before you submit.",
    "You solve problems step by step. Use the tools to compute; call submit exactly once with the answer.",
    "You are an agent in a sandboxed workspace. Think briefly, run code, then submit.",
    "You are a helpful assistant. Answer with a single number using the submit tool.",
    "Solve the task. The workspace is /workspace; files mentioned by the user are there.",
]
_UNICODE_NOTES = [
    "✓ done", "résumé", "naïve café", "東京 → 大阪", "π ≈ 3.14159", "🙂", "Grüße", "über-fast", "x² + y² = r²",
    "Привет, мир", "¿Qué tal?", "€12.50", "≤ 10", "½ cup", "—", "数学", "한국어", "∑ i",
]  # fmt: skip
_FILES = [
    "data.txt", "log.csv", "notes.md", "src/main.py", "input.json", "users.csv", "report.txt",
    "tests/test_main.py", "config.yaml", "scores.tsv", "README.md", "app/utils.py",
]  # fmt: skip
_ERRORS = [
    'Traceback (most recent call last):\n  File "<stdin>", line 1\nSyntaxError: invalid syntax',
    "Traceback (most recent call last):\n  File \"<string>\", line 2, in <module>\nNameError: name 'x' is not defined",
    "ZeroDivisionError: division by zero",
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    "bash: line 1: pyhton: command not found",
    "cat: missing.txt: No such file or directory",
    'Error: near "SELEC": syntax error',
    "[timeout after 10s]",
]


def _sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ":"])


def _arith(rng: random.Random) -> tuple[str, str, int]:
    a, b, c = rng.randint(2, 99999), rng.randint(2, 999), rng.randint(1, 5000)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expr = f"{a} {op1} {b} {op2} {c}"
    question = rng.choice(
        ["What is {e}?", "Compute {e}.", "Calculate {e} and submit the result.", "{e} = ?", "Evaluate: {e}"]
    )
    code = rng.choice([f"print({expr})", f"x = {expr}\nprint(x)", f"result = {expr}\nprint(result)"])
    return question.format(e=expr), code, eval(expr)  # expr is built from ints and + - * only


def _word(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if rng.random() < 0.5:
        have, bags, per, gave = rng.randint(1, 50), rng.randint(2, 9), rng.randint(2, 12), rng.randint(0, 20)
        question = (
            f"{name} has {have} {item}, buys {bags} bags with {per} {item} each, "
            f"then gives away {gave}. How many {item} does {name} have now?"
        )
        code = f"have = {have}\nhave += {bags} * {per}\nhave -= {gave}\nprint(have)"
        return question, code, have + bags * per - gave
    amount, dur, rate = rng.choice(_UNITS)
    r, t = rng.randint(2, 90), rng.randint(2, 12)
    question = f"{name} travels at {r} {rate} for {t} {dur}. How many {amount} in total?"
    return question, f"rate = {r}\n{dur} = {t}\nprint(rate * {dur})", r * t


def _bash(rng: random.Random) -> tuple[str, dict[str, Any], str, int]:
    fname, n, word = rng.choice(_FILES), rng.randint(0, 400), rng.choice(_WORDS)
    kind = rng.randrange(5)
    if kind == 0:
        question = rng.choice([f"How many lines does {fname} have?", f"Count the lines in `{fname}`."])
        return question, {"command": f"wc -l {fname}"}, f"{n} {fname}", n
    if kind == 1:
        question = f"How many lines of {fname} contain the word '{word}'?"
        return question, {"command": f'grep -c "{word}" {fname}'}, str(n), n
    if kind == 2:
        question = "How many Python files are in the workspace?"
        listing = "\n".join(f"./{rng.choice(_WORDS)}_{i}.py" for i in range(n % 6 + 1))
        return question, {"command": 'find . -name "*.py" | sort'}, listing, n % 6 + 1
    if kind == 3:
        question = f"What is the largest value in the second column of {fname}?"
        cmd = f"awk -F, '{{print $2}}' {fname} | sort -n | tail -n 1"
        return question, {"command": cmd}, str(n), n
    question = f"How many distinct words are on the first {n % 20 + 1} lines of {fname}?"
    cmd = f"head -n {n % 20 + 1} {fname} | tr ' ' '\\n' | sort | uniq | wc -l"
    return question, {"command": cmd}, str(n), n


def _sql(rng: random.Random) -> tuple[str, dict[str, Any], str, int]:
    who, total, year = rng.choice(_NAMES).lower(), rng.randint(10, 99999), rng.randint(2015, 2025)
    kind = rng.randrange(4)
    if kind == 0:
        question = (
            f"The table orders(id, customer, amount) is in db.sqlite. What is the total amount for '{who}'?"
        )
        query = f"SELECT SUM(amount) FROM orders WHERE customer = '{who}';"
    elif kind == 1:
        question = f"How many users signed up in {year}? Use the users table."
        query = f"SELECT COUNT(*) FROM users WHERE strftime('%Y', created_at) = '{year}';"
    elif kind == 2:
        question = "Which department has the highest average salary? Submit that average, rounded down."
        query = (
            "SELECT department, CAST(AVG(salary) AS INTEGER) AS avg_salary FROM employees "
            "GROUP BY department ORDER BY avg_salary DESC LIMIT 1;"
        )
    else:
        question = "How many products were never ordered?"
        query = (
            "SELECT COUNT(*) FROM products p LEFT JOIN order_items o ON o.product_id = p.id "
            "WHERE o.id IS NULL;"
        )
    return question, {"query": query}, f"[({total},)]", total


def _code(rng: random.Random) -> tuple[str, str, int]:
    n = rng.randint(2, 200)
    kind = rng.randrange(3)
    if kind == 0:
        code = (
            "def is_prime(n):\n    if n < 2:\n        return False\n"
            "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n            return False\n"
            f"    return True\n\nprint(sum(is_prime(k) for k in range({n})))"
        )
        answer = sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n))
        return f"Write a function is_prime(n) and use it to count the primes below {n}.", code, answer
    if kind == 1:
        code = f"import math\n\nprint(math.factorial({n % 12}) % 1000)"
        return f"What are the last three digits of {n % 12}!?", code, math.factorial(n % 12) % 1000
    words = [rng.choice(_WORDS) for _ in range(n % 9 + 2)]
    text = " ".join(words)
    code = f'text = "{text}"\ncounts = {{}}\nfor w in text.split():\n    counts[w] = counts.get(w, 0) + 1\nprint(len(counts))'
    return f'How many distinct words are in "{text}"?', code, len(set(words))


def _transcript(rng: random.Random) -> Transcript:
    kind = rng.choice(["arith", "word", "bash", "sql", "code", "chat"])
    system = {"role": "system", "content": rng.choice(_SYSTEMS)}
    if kind == "chat":  # plain chat without tools keeps the no-tools branch of the template in the corpus
        note = rng.choice(_UNICODE_NOTES)
        return Transcript(
            [
                system,
                {"role": "user", "content": f"{_sentence(rng, rng.randint(4, 14))} ({note})"},
                {
                    "role": "assistant",
                    "content": " ".join(_sentence(rng, rng.randint(3, 12)) for _ in range(3)),
                },
            ],
            None,
        )
    tools = [PYTHON_TOOL, SUBMIT_TOOL]
    if kind in ("arith", "word", "code"):
        question, code, answer = {"arith": _arith, "word": _word, "code": _code}[kind](rng)
        call = {"name": "python", "arguments": {"code": code}}
        result = str(answer)
    elif kind == "bash":
        question, args, result, answer = _bash(rng)
        tools = [BASH_TOOL, PYTHON_TOOL, SUBMIT_TOOL]
        call = {"name": "bash", "arguments": args}
    else:
        question, args, result, answer = _sql(rng)
        tools = [SQL_TOOL, SUBMIT_TOOL]
        call = {"name": "sql", "arguments": args}
    messages: list[dict[str, Any]] = [system, {"role": "user", "content": question}]
    if rng.random() < 0.3:  # a failed first attempt, so tracebacks and retries are in the corpus
        messages += [
            {
                "role": "assistant",
                "content": _sentence(rng, 5),
                "tool_calls": [{"type": "function", "function": call}],
            },
            {"role": "tool", "name": call["name"], "content": rng.choice(_ERRORS)},
        ]
    thought = rng.choice(
        ["", "Let me compute that.", "I'll use the tool.", "Running it now.", _sentence(rng, 8)]
    )
    messages += [
        {"role": "assistant", "content": thought, "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "name": call["name"], "content": result},
        {
            "role": "assistant",
            "content": rng.choice([f"The result is {answer}.", "", f"So the answer is {answer}."]),
            "tool_calls": [
                {"type": "function", "function": {"name": "submit", "arguments": {"answer": answer}}}
            ],
        },
        {"role": "tool", "name": "submit", "content": rng.choice(["submitted", "correct", "accepted ✓"])},
        {"role": "assistant", "content": f"The answer is {answer}. {rng.choice(_UNICODE_NOTES)}"},
    ]
    return Transcript(messages, tools)


def synthetic_transcripts(seed: int, n: int) -> list[Transcript]:
    """`n` tool-use conversations resembling our environments' episodes, reproducible from `seed`."""
    rng = random.Random(seed)
    return [_transcript(rng) for _ in range(n)]


def render(transcript: Transcript, add_generation_prompt: bool = False) -> str:
    """Render one transcript with `CHAT_TEMPLATE`, exactly as `apply_chat_template(tokenize=False)` would."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[transcript.messages],
        tools=transcript.tools,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
    )
    return rendered[0]


def corpus_texts(transcripts: Iterable[Transcript]) -> Iterator[str]:
    """The training text: each transcript rendered by the chat template, so merges fit what the model sees."""
    for transcript in transcripts:
        yield render(transcript)


# ---------------------------------------------------------------------------------------------------------
# Training and wrapping


def train_tokenizer(
    out_dir: Path, recipe: TokenizerRecipe = TokenizerRecipe(), texts: Iterable[str] | None = None
):
    """Train the byte-level BPE, save it with `save_pretrained` into `out_dir`, and return the loaded tokenizer.

    `texts` defaults to the rendered `synthetic_transcripts` of the recipe. The result is what
    `AutoTokenizer.from_pretrained(out_dir)` gives (a `Qwen2Tokenizer`), not the in-memory object, so the
    caller sees exactly what every later user will load.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import AutoTokenizer, Qwen2Tokenizer

    if texts is None:
        texts = corpus_texts(synthetic_transcripts(recipe.corpus_seed, recipe.corpus_transcripts))
    bpe = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # The same pipeline `Qwen2Tokenizer.__init__` builds; it is rebuilt on load, so it must match.
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=recipe.min_frequency,
        # All 256 byte symbols, seen or not: any UTF-8 text must encode, not only the corpus's characters.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    model_json = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]

    tok = Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        # <|endoftext|> first so that it gets the first id after the learned vocabulary, as in Qwen2.5;
        # eos becomes <|im_end|> below, once the tokens are in their order.
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=32768,
        errors="replace",
    )
    # Appended after the learned vocabulary in this order, as in Qwen2.5 (endoftext, im_start, im_end, ...).
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})

    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    # A chat model stops at the end of its turn, not at the end of the document.
    tok.eos_token = IM_END
    tok.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    loaded = AutoTokenizer.from_pretrained(out_dir)
    for token in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        ids = loaded.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(
                f"{token!r} encodes to {ids} after save/load, expected one id; tokenizer_kit is broken"
            )
    return loaded
