"""The observation-token masker against our tiny template and the two real templates in ../shared/chat_templates/.

Each test builds a tool-calling trajectory the way the rollout does (prompt, sampled turn, glue +
observation delta, ...) with sampled ids given by hand, then checks the loss mask piece by piece and
the drift check's verdict.

The Llama 3.1 template is tested at the token level: the tiny tokenizer lacks Llama's special
tokens, so the test adds them (`<|begin_of_text|>` as BOS, `<|start_header_id|>`, `<|end_header_id|>`,
`<|eot_id|>`, `<|eom_id|>`, `<|python_tag|>`) as added special tokens; no model is involved.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.rollout.masker import DRIFT_METRICS, ChatMasker, MaskedSequence
from tests import fixtures_model

tiny_model_dir = fixtures_model.tiny_model_dir  # the session-wide tiny model, as a fixture of this module

TEMPLATES = Path(__file__).resolve().parents[2].parent / "shared" / "chat_templates"
if not TEMPLATES.is_dir():
    TEMPLATES = Path("/work/shared/chat_templates")
HERMES = TEMPLATES / "hermes_tool_chat_template.jinja"
LLAMA31 = TEMPLATES / "llama3.1_json_tool_chat_template.jinja"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python 3 code and return what it printed.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The program."}},
                "required": ["code"],
            },
        },
    }
]
FIRST = [
    {"role": "system", "content": "You are a careful calculator. Use the tools."},
    {"role": "user", "content": "What is 6 * 7 + 1?"},
]
HERMES_ACTIONS = [
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(42 + 1)"}}\n</tool_call>',
    '<tool_call>\n{"name": "submit", "arguments": {"answer": "43"}}\n</tool_call>',
]
OBSERVATIONS = [
    [{"role": "tool", "name": "python", "tool_call_id": "call_0", "content": "42"}],
    [{"role": "tool", "name": "python", "tool_call_id": "call_0", "content": "43"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": [
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ],
        }
    )
    return tok


def build(
    masker: ChatMasker,
    actions: list[list[int]],
    observations: list[list[dict]],
    finish: list[str] | None = None,
) -> tuple[MaskedSequence, list[list[int]]]:
    """Run the rollout's append loop over hand-given sampled ids; return the sequence and each forced piece."""
    seq = masker.start(FIRST)
    forced = [list(seq.token_ids)]
    for i, ids in enumerate(actions):
        masker.add_turn(seq, ids, [-0.25] * len(ids), (finish or ["stop"] * len(actions))[i])
        if i < len(observations):
            piece = masker.observation_ids(seq, observations[i])
            masker.add_observation(seq, observations[i], piece)
            forced.append(piece)
    return seq, forced


def runs(seq: MaskedSequence, value: int) -> list[list[int]]:
    """Maximal runs of ids whose mask equals `value`, in order."""
    out: list[list[int]] = []
    prev = None
    for tok, m in zip(seq.token_ids, seq.loss_mask, strict=True):
        if m == value:
            if prev != value:
                out.append([])
            out[-1].append(tok)
        prev = m
    return out


def sampled(masker: ChatMasker, text: str) -> list[int]:
    """Canonical ids of `text` plus the end-of-turn token: what a trained model samples."""
    return [*masker.encode(text), masker.end_of_turn_id]


def check_pieces(
    masker: ChatMasker, seq: MaskedSequence, actions: list[list[int]], forced: list[list[int]]
) -> None:
    assert runs(seq, 1) == actions  # every sampled id, in order, nothing else
    assert runs(seq, 0) == forced  # prompt, then glue + observation + generation prompt per turn
    assert all(lp == 0.0 for lp, m in zip(seq.behavior_logprobs, seq.loss_mask, strict=True) if m == 0)
    assert all(lp == -0.25 for lp, m in zip(seq.behavior_logprobs, seq.loss_mask, strict=True) if m == 1)


def test_tiny_qwen_template_tool_turns_are_drift_free(tokenizer) -> None:
    masker = ChatMasker(tokenizer)
    assert masker.turn_close == "<|im_end|>\n"
    assert masker.decode([masker.end_of_turn_id]) == "<|im_end|>"
    actions = [sampled(masker, a) for a in HERMES_ACTIONS]
    seq, forced = build(masker, actions, OBSERVATIONS)
    check_pieces(masker, seq, actions, forced)
    # The forced piece after a turn is exactly: the "\n" the template adds after <|im_end|>, the tool
    # result as Qwen renders it (a user turn with <tool_response>), and the next generation prompt.
    assert (
        masker.decode(forced[1])
        == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert masker.check_drift(seq).drifted is False


def test_hermes_real_template_is_drift_free(tokenizer) -> None:
    masker = ChatMasker(tokenizer, chat_template=HERMES.read_text(), tools=TOOLS)
    assert masker.generation_prompt == "<|im_start|>assistant\n"
    assert masker.turn_close == "<|im_end|>\n"
    actions = [sampled(masker, a) for a in HERMES_ACTIONS]
    seq, forced = build(masker, actions, OBSERVATIONS)
    check_pieces(masker, seq, actions, forced)
    assert masker.decode(forced[1]) == (
        '\n<|im_start|>tool\n<tool_response>\n{"name": "python", "content": "42"}\n</tool_response> <|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    # The prompt is the template's own tool preamble (tools= passed through), tokenized once.
    assert "<tools>" in masker.decode(forced[0])
    before = DRIFT_METRICS["drift/checked"]
    report = masker.check_drift(seq)
    assert report.drifted is False, report.detail
    assert DRIFT_METRICS["drift/checked"] == before + 1


def test_llama31_template_drift_is_reported_not_fixed(llama_tokenizer) -> None:
    """Llama 3.1 is not append-only: it re-renders assistant content `| trim`-ed.

    What this test shows: the masker keeps the ids the policy sampled (and showed the policy during the
    rollout), and the drift check REPORTS where a full re-render differs ("template" drift at the first
    trimmed character). A tool-call turn without surrounding whitespace is drift-free, so the report is
    not a false alarm.
    """
    masker = ChatMasker(
        llama_tokenizer,
        chat_template=LLAMA31.read_text(),
        tools=TOOLS,
        template_kwargs={"date_string": "21 Nov 2026"},  # the template reads the clock otherwise
    )
    assert masker.generation_prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert masker.turn_close == "<|eot_id|>"  # no glue after the end-of-turn token in Llama 3
    observations = [
        [{"role": "tool", "name": "python", "content": "42"}],
        [{"role": "tool", "name": "python", "content": "43"}],
    ]
    clean = [
        '{"name": "python", "parameters": {"code": "print(6 * 7)"}}',
        '{"name": "python", "parameters": {"code": "print(42 + 1)"}}',
        "The answer is 43.",
    ]
    actions = [sampled(masker, a) for a in clean]
    seq, forced = build(masker, actions, observations)
    check_pieces(masker, seq, actions, forced)
    assert masker.decode(forced[1]) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "42"}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert masker.check_drift(seq).drifted is False

    # A model that ends its tool call with a newline (common) or starts its answer with a space.
    untrimmed = [clean[0] + "\n", clean[1], " " + clean[2]]
    actions = [sampled(masker, a) for a in untrimmed]
    seq, forced = build(masker, actions, observations)
    check_pieces(masker, seq, actions, forced)
    assert masker.decode(runs(seq, 1)[0]) == untrimmed[0] + "<|eot_id|>"  # trained ids = sampled ids
    with pytest.warns(UserWarning, match="drift"):
        report = masker.check_drift(seq)
    assert report.drifted and report.kind == "template"
    # The first differing id is in the first turn, where the trimmed "\n" was (BPE may have merged it
    # with the characters before it).
    ours, theirs = masker.encode(untrimmed[0]), masker.encode(clean[0])
    diverge = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    assert report.first_mismatch == len(forced[0]) + diverge
    before = DRIFT_METRICS["drift/template"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        masker.check_drift(seq)
    assert DRIFT_METRICS["drift/template"] == before + 1


def test_length_stop_gets_the_whole_turn_close_as_glue(tokenizer) -> None:
    masker = ChatMasker(tokenizer)
    cut = masker.encode('<tool_call>\n{"name": "python", "argu')  # max_tokens ran out: no <|im_end|>
    actions = [cut, sampled(masker, HERMES_ACTIONS[2])]
    seq, forced = build(
        masker,
        actions,
        [[{"role": "user", "content": "Error: unterminated <tool_call>"}]],
        ["length", "stop"],
    )
    check_pieces(masker, seq, actions, forced)
    # The template's <|im_end|> closes the cut turn, with mask 0: the model never sampled it.
    assert masker.decode(forced[1]).startswith("<|im_end|>\n<|im_start|>user\nError")
    assert masker.end_of_turn_id not in runs(seq, 1)[0]
    assert masker.check_drift(seq).drifted is False


def test_stop_on_a_token_that_is_not_the_end_of_turn(tokenizer) -> None:
    masker = ChatMasker(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    action = [*masker.encode("hello"), eos]
    seq, forced = build(masker, [action], [[{"role": "user", "content": "Error: no tool call"}]], ["stop"])
    assert masker.action_text(action, "stop") == "hello<|endoftext|>"  # the env sees what was sampled
    assert masker.decode(forced[1]).startswith("<|im_end|>\n")  # the template's close, all glue


def test_non_canonical_sampled_tokens_are_reported_as_tokenization_drift(tokenizer) -> None:
    masker = ChatMasker(tokenizer)
    text = "print the result"
    canonical = masker.encode(text)
    # The same text, one byte-level token per character: a sampler can produce this; re-tokenizing would not.
    split = [i for ch in text for i in masker.encode(ch)]
    assert split != canonical and masker.decode(split) == text
    action = [*split, masker.end_of_turn_id]
    seq, _ = build(masker, [action, sampled(masker, HERMES_ACTIONS[2])], [OBSERVATIONS[0]])
    assert runs(seq, 1)[0] == action  # kept as sampled
    with pytest.warns(UserWarning, match="tokenization"):
        report = masker.check_drift(seq)
    assert report.drifted and report.kind == "tokenization"
    assert report.first_mismatch == seq.prompt_len + next(
        i for i, (a, b) in enumerate(zip(split, canonical, strict=False)) if a != b
    )


def test_template_without_a_turn_close_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="no end-of-turn token"):
        ChatMasker(tokenizer, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
