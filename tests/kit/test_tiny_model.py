"""The local model kit: tokenizer, chat template, tiny Qwen2 model, and the vLLM round trip."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.kit.tiny_model import RECIPE_FILE, init_tiny, vllm_round_trip
from agentrl.kit.tokenizer import (
    CHAT_TEMPLATE,
    PYTHON_TOOL,
    SPECIAL_TOKENS,
    SUBMIT_TOOL,
    TOOL_TOKENS,
    TokenizerRecipe,
    render,
    synthetic_transcripts,
    train_tokenizer,
)
from tests import fixtures_model

# The shared session fixture, bound to a name here so that pytest finds it in this module.
tiny_model_dir = fixtures_model.tiny_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _call(name: str, arguments: dict | str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# A conversation with every kind of turn: system + tools, user, assistant with text and a tool call,
# tool result, assistant with two tool calls and no text, two consecutive tool results, assistant final.
CONVERSATION: list[dict] = [
    {"role": "system", "content": "Solve it."},
    {"role": "user", "content": "What is 3*7? Then 2+2."},
    {
        "role": "assistant",
        "content": "Let me run it.",
        "tool_calls": [_call("python", {"code": "print(3*7)"})],
    },
    {"role": "tool", "name": "python", "content": "21"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [_call("python", {"code": "print(2+2)"}), _call("submit", {"answer": 21})],
    },
    {"role": "tool", "name": "python", "content": "4"},
    {"role": "tool", "name": "submit", "content": "correct ✓"},
    {"role": "assistant", "content": "The answer is 21."},
]
TOOLS = [PYTHON_TOOL, SUBMIT_TOOL]


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


def test_special_and_tool_tokens_are_single_ids_appended_after_the_vocabulary(tok) -> None:
    ids = [tok.encode(t, add_special_tokens=False) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)]
    assert all(len(i) == 1 for i in ids), ids
    flat = [i[0] for i in ids]
    assert flat == list(range(len(tok) - 7, len(tok))), (
        "Qwen2.5 order: endoftext, im_start, im_end, tool tags"
    )
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None


def test_tool_tags_survive_skip_special_tokens_but_control_tokens_do_not(tok) -> None:
    # The tool-call parser reads decoded text, so the tags must stay; <|im_end|> must go.
    ids = tok.encode('<tool_call>\n{"name": "submit"}\n</tool_call><|im_end|>', add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "submit"}\n</tool_call>'


def test_tokenizer_loads_as_qwen2_tokenizer_and_compresses_transcripts(tok) -> None:
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert 2000 <= len(tok) <= 4200
    text = render(synthetic_transcripts(seed=123, n=1)[0])
    assert len(tok.encode(text)) < len(text) / 3, "a BPE trained on transcripts should compress them >3x"


@pytest.mark.parametrize(
    "text",
    [pytest.param(render(t), id=f"transcript{i}") for i, t in enumerate(synthetic_transcripts(seed=99, n=4))]
    + [
        "Grüße aus Łódź — naïve café, 東京 → 大阪, Привет, 🦀🙂, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "  leading spaces, trailing tabs\t\t\n\n\r\nand CRLF\r\n",
        'print("tab\\there")\n\tindented\n    x = {"a": [1, 2.5e-3, None]}',
        "SELECT COUNT(*) FROM t WHERE name LIKE '%é%';",
        "",
    ],
)
def test_decode_encode_round_trips(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_text_is_nfc_normalized_like_qwen2(tok) -> None:
    # Qwen2's tokenizer normalises to NFC: "e" + combining acute comes back as the single code point "é".
    # Round trips are exact only for NFC text; the masker must keep sampled ids, not re-encode text.
    decomposed = "cafe\u0301"
    assert tok.decode(tok.encode(decomposed)) == "caf\u00e9"


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    recipe = TokenizerRecipe(vocab_size=1024, corpus_transcripts=200)
    train_tokenizer(tmp_path / "a", recipe)
    train_tokenizer(tmp_path / "b", recipe)
    for name in TOKENIZER_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------------------
# Chat template


EXPECTED_RENDER = (
    "<|im_start|>system\nSolve it.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(PYTHON_TOOL, ensure_ascii=False)
    + "\n"
    + json.dumps(SUBMIT_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWhat is 3*7? Then 2+2.<|im_end|>\n"
    "<|im_start|>assistant\nLet me run it.\n<tool_call>\n"
    '{"name": "python", "arguments": {"code": "print(3*7)"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n21\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "python", "arguments": {"code": "print(2+2)"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "submit", "arguments": {"answer": 21}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\ncorrect ✓\n</tool_response>"
    "<|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 21.<|im_end|>\n"
)


def test_chat_template_renders_qwen25_hermes_format(tok) -> None:
    assert tok.chat_template == CHAT_TEMPLATE
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert rendered == EXPECTED_RENDER


def test_chat_template_without_tools_and_without_system(tok) -> None:
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_call_arguments_given_as_a_json_string_are_inserted_verbatim(tok) -> None:
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [_call("python", '{"code": "print(1)"}')]},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call><|im_end|>\n'
        in rendered
    )


def test_chat_template_is_append_only_at_every_assistant_boundary(tok) -> None:
    boundaries = [k for k, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
    assert len(boundaries) == 3
    for k in boundaries:
        prompt = tok.apply_chat_template(
            CONVERSATION[:k], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        full = tok.apply_chat_template(CONVERSATION[: k + 1], tools=TOOLS, tokenize=False)
        longer = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
        assert full.startswith(prompt), f"generation prompt before message {k} is not a prefix"
        assert full.endswith("<|im_end|>\n"), "an assistant turn must end with <|im_end|> and a newline"
        assert longer.startswith(full), f"the conversation through message {k} is not a prefix of the whole"
        # The same holds for token ids: the turn's own ids follow the prompt's ids unchanged.
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        full_ids = tok.encode(full, add_special_tokens=False)
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert full_ids[-2:] == tok.encode("<|im_end|>\n", add_special_tokens=False)


def test_consecutive_tool_results_share_one_user_turn_as_in_qwen25(tok) -> None:
    # The one place the template is not append-only (shared with Qwen2.5): a rendering that ends on a tool
    # result is closed with <|im_end|>, which the next tool result reopens. The masker never cuts there.
    k = 6  # CONVERSATION[5] and [6] are both tool results
    first = tok.apply_chat_template(CONVERSATION[:k], tools=TOOLS, tokenize=False)
    both = tok.apply_chat_template(CONVERSATION[: k + 1], tools=TOOLS, tokenize=False)
    assert first.endswith("</tool_response><|im_end|>\n")
    assert not both.startswith(first)
    assert both.count("<|im_start|>user\n<tool_response>\n4") == 1


def test_the_projects_hermes_parser_reads_the_tool_calls_the_template_renders(tok) -> None:
    from agentrl.env.parsers import HermesParser

    k = 4  # the assistant turn with two tool calls and no text
    prompt = tok.apply_chat_template(
        CONVERSATION[:k], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    full = tok.apply_chat_template(CONVERSATION[: k + 1], tools=TOOLS, tokenize=False)
    action = full[len(prompt) : -len("<|im_end|>\n")]  # what the model would have sampled
    parsed = HermesParser().parse(action)
    assert not parsed.errors and parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("python", {"code": "print(2+2)"}),
        ("submit", {"answer": 21}),
    ]


# ---------------------------------------------------------------------------------------------------------
# Model


def test_model_loads_through_auto_classes(tiny_model_dir: Path, tok) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads == 64, "vLLM's CPU attention needs head_dim 64"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.vocab_size == len(tok)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), (
        "embeddings are tied"
    )
    assert model.dtype == torch.float32
    eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id == eos
    assert config.eos_token_id == eos[0]

    ids = tok.apply_chat_template(
        CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids  # [1, T]
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=4, do_sample=False)  # [1, T + 4] at most
    assert out.shape[1] > ids.shape[1]


def test_same_seed_gives_byte_identical_files_and_another_seed_other_weights(
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    again = init_tiny(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = init_tiny(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()
    for name in TOKENIZER_FILES:  # the tokenizer does not depend on the model seed
        assert (other / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_init_tiny_reuses_a_matching_build_and_rebuilds_another_recipe(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    t0 = time.perf_counter()
    assert init_tiny(tiny_model_dir, seed=0) == tiny_model_dir
    assert time.perf_counter() - t0 < 1.0
    assert before == {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}

    out = init_tiny(tmp_path / "m", seed=0, num_hidden_layers=1)
    first_hash = json.loads((out / RECIPE_FILE).read_text())["hash"]
    init_tiny(out, seed=0, num_hidden_layers=2)
    assert json.loads((out / RECIPE_FILE).read_text())["hash"] != first_hash
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_init_tiny_refuses_a_directory_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a model-kit build"):
        init_tiny(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_unknown_override_says_what_was_meant(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="did you mean 'num_hidden_layers'"):
        init_tiny(tmp_path / "m", num_hidden_layer=2)


@pytest.mark.slow
def test_cli_model_init_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "model", "init", "tiny", "--out", str(out), "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert json.loads((out / RECIPE_FILE).read_text())["recipe"]["seed"] == 3


# ---------------------------------------------------------------------------------------------------------
# vLLM round trip

# The same math in a different order. Measured here: 1e-6 in float32, 8e-3 in bfloat16. The float32 bound
# leaves room for other CPUs' kernels while still catching any real mismatch (a wrong RoPE base, bias or
# norm moves log-probs by 1e-2 or more); bfloat16 is there to show the engine's default dtype loads and
# agrees to bfloat16 precision. A greedy choice can flip on a near-tie in bfloat16, not in float32.
ROUND_TRIP_TOLERANCES = {
    "float32": (1e-3, 1.0),  # (max |logprob difference|, minimum greedy agreement)
    "bfloat16": (5e-2, 0.95),
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("dtype", list(ROUND_TRIP_TOLERANCES))
def test_vllm_matches_transformers_greedy_tokens_and_logprobs(tiny_model_dir: Path, tok, dtype: str) -> None:
    atol, min_agreement = ROUND_TRIP_TOLERANCES[dtype]
    prompts = [
        tok.apply_chat_template(t.messages[:2], tools=t.tools, add_generation_prompt=True, return_dict=False)
        for t in synthetic_transcripts(seed=7, n=3)
    ]
    prompts.append(tok.encode("<|im_start|>user\nPrivet, мир 🙂<|im_end|>\n<|im_start|>assistant\n"))
    rt = vllm_round_trip(tiny_model_dir, prompts, max_tokens=16, dtype=dtype)
    print(
        f"{dtype}: vLLM start-up {rt.startup_s:.1f}s, generate {rt.generate_s:.1f}s, greedy agreement "
        f"{rt.greedy_agreement:.3f}, max |dlogprob| sampled {rt.max_abs_logprob_diff:.2e}, "
        f"prompt {rt.max_abs_prompt_logprob_diff:.2e}"
    )
    assert all(0 < len(t) <= 16 for t in rt.vllm_tokens)
    assert rt.greedy_agreement >= min_agreement
    assert rt.max_abs_logprob_diff < atol
    assert rt.max_abs_prompt_logprob_diff < atol
    # vLLM detokenizes through the tokenizer it loaded from the same directory.
    assert rt.vllm_texts == [tok.decode(t, skip_special_tokens=True) for t in rt.vllm_tokens]
