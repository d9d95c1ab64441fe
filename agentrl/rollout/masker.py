"""The observation-token masker: token ids are the truth, the chat template only supplies the glue.

One `MaskedSequence` per episode. The rollout appends, in one loop:

- the prompt: the chat template's rendering of the first messages with the generation prompt,
  tokenized once (`loss_mask` 0);
- each turn's sampled ids exactly as the policy produced them, its end-of-turn token included
  (`loss_mask` 1, with the behaviour log-probs);
- after each turn, the template glue that closes the assistant turn and that the model did not
  sample (Qwen/Hermes: the `\\n` after `<|im_end|>`), the observation messages and the next
  generation prompt, rendered once as a delta and tokenized once (`loss_mask` 0).

A turn that stopped on `max_tokens` has no end-of-turn token: the template's whole turn close
(`<|im_end|>\\n`) is appended as glue with mask 0, so the context the model sees next is what the
template would show, and the model is never trained to emit an end-of-turn token it did not sample.

The delta of an observation is `render(ctx + new, generation prompt)` minus `render(ctx)`, where
`ctx` is a fixed two-message context (system, user) followed by this turn's assistant message
(its content = the decoded sampled text): constant cost per turn, whatever the episode's length.
When the shorter rendering is not a prefix of the longer one, the template is not append-only
there; the delta then starts where the two renderings diverge and the episode's drift report says
so. `check_drift` re-renders the whole final conversation and compares ids; it reports
(`DriftReport`, a metric counter, a warning) and never changes the ids:

- `tokenization`: the text is identical but the ids differ (the policy sampled a non-canonical
  tokenization, or the tokenizer merges across a boundary): re-tokenizing would train on tokens
  the policy never sampled.
- `template`: the text differs (the template rewrites history: trims content, restructures turns).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.core.types import Message
from agentrl.rollout.trajectory import DriftReport

if TYPE_CHECKING:
    from agentrl.rollout.policy import StopReason

log = logging.getLogger(__name__)


# Rollout metrics: how many trajectories were checked, and how many drifted (by kind).
DRIFT_METRICS: Counter[str] = Counter()
_metrics_lock = threading.Lock()

_PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_MARK = "\u27e6agentrl-mark\u27e7"


@dataclass
class MaskedSequence:
    """The ids of one episode, with the loss mask and behaviour log-probs built as they are appended."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    prompt_len: int
    messages: list[Message]
    """The conversation as the policy has seen it (what the drift check re-renders)."""
    ends_in_generation_prompt: bool = True
    """True after the prompt or an observation; False right after a sampled turn."""
    last_stop_reason: StopReason = "stop"
    notes: list[str] = field(default_factory=list)
    """Template problems met while appending (non-prefix renderings), for the drift report."""
    token_versions: list[int] = field(default_factory=list)
    """The weights version each id was sampled with; -1 for ids not sampled (the prompt, observations)."""

    def __post_init__(self) -> None:
        # Ids given at construction (the prompt) were not sampled.
        self.token_versions.extend([-1] * (len(self.token_ids) - len(self.token_versions)))

    def __len__(self) -> int:
        return len(self.token_ids)

    def append_sampled(
        self,
        token_ids: list[int],
        logprobs: list[float],
        stop_reason: StopReason,
        versions: list[int] | None = None,
    ) -> None:
        """`versions`: the weights version of each id (`Generation.versions()`); None: unknown (-1)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled ids but {len(logprobs)} log-probs")
        if versions is not None and len(versions) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled ids but {len(versions)} versions")
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.behavior_logprobs.extend(logprobs)
        self.token_versions.extend(versions if versions is not None else [-1] * len(token_ids))
        self.ends_in_generation_prompt = False
        self.last_stop_reason = stop_reason

    def append_forced(self, token_ids: list[int]) -> None:
        """Ids the policy did not sample (glue, observations, generation prompt): mask 0."""
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.behavior_logprobs.extend([0.0] * len(token_ids))
        self.token_versions.extend([-1] * len(token_ids))


class ChatMasker:
    """Renders prompts, turn closes and observation deltas with one chat template and one tokenizer.

    `tokenizer` is a Hugging Face tokenizer; `chat_template` overrides its template (a Jinja string);
    `tools` are passed to the template on every rendering (leave None when the environment already
    writes the tool schemas into the system prompt, as `ToolEnv(tools_in_prompt=True)` does);
    `template_kwargs` go to `apply_chat_template` (e.g. a fixed `date_string`).
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tools = tools
        self.template_kwargs = dict(template_kwargs or {})
        gen = self.render(_PROBE, add_generation_prompt=True)
        full = self.render([*_PROBE, {"role": "assistant", "content": _MARK}], add_generation_prompt=False)
        if not full.startswith(gen) or _MARK not in full[len(gen) :]:
            raise ValueError(
                "this chat template does not render an assistant turn after its generation prompt "
                f"(generation prompt ends {gen[-40:]!r}, assistant turn renders {full[len(gen) - 40 :]!r}); "
                "the masker needs render(messages, add_generation_prompt=True) to be a prefix of the rendering "
                "with the assistant message added"
            )
        after = full[len(gen) :]
        self.generation_prompt = gen[len(self.render(_PROBE, add_generation_prompt=False)) :]
        self.turn_close = after[after.index(_MARK) + len(_MARK) :]
        """Text the template puts after an assistant message's content (Qwen: `<|im_end|>\\n`)."""
        self.turn_close_ids = self.encode(self.turn_close)
        if not self.turn_close_ids:
            raise ValueError(
                "this chat template closes assistant turns with nothing; there is no end-of-turn token"
            )
        self.end_of_turn_id = self.turn_close_ids[0]
        """The token that ends a turn: the policy's stop token, trained with mask 1 when sampled."""

    # --- rendering -------------------------------------------------------------------------------------

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.tools is not None:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, **kwargs, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        # The template writes special tokens as text; they must map to their ids, and nothing is added.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.end_of_turn_id]

    # --- the append loop's pieces ---------------------------------------------------------------------

    def start(self, messages: list[Message]) -> MaskedSequence:
        """The prompt: the first messages rendered with the generation prompt, tokenized once."""
        ids = self.encode(self.render(messages, add_generation_prompt=True))
        return MaskedSequence(
            token_ids=list(ids),
            loss_mask=[0] * len(ids),
            behavior_logprobs=[0.0] * len(ids),
            prompt_len=len(ids),
            messages=[dict(m) for m in messages],
        )

    def action_text(self, sampled_ids: list[int], stop_reason: StopReason) -> str:
        """What the policy wrote this turn, for the environment: the sampled text minus the end-of-turn token."""
        ids = sampled_ids
        if stop_reason == "stop" and ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.decode(ids)

    def close_glue(self, sampled_ids: list[int], stop_reason: StopReason) -> str:
        """Template text after the sampled ids that closes the turn and that the model did not sample."""
        if stop_reason == "stop" and sampled_ids and sampled_ids[-1] == self.end_of_turn_id:
            return self.turn_close[len(self.decode([self.end_of_turn_id])) :]
        # A length stop, or a stop on some other token (a model EOS that is not the template's
        # end-of-turn): the template still closes the turn, and none of that was sampled.
        return self.turn_close

    def add_turn(
        self,
        seq: MaskedSequence,
        sampled_ids: list[int],
        logprobs: list[float],
        stop_reason: StopReason,
        versions: list[int] | None = None,
    ) -> str:
        """Append one sampled turn (mask 1); return the action text for the environment."""
        seq.append_sampled(sampled_ids, logprobs, stop_reason, versions)
        text = self.action_text(sampled_ids, stop_reason)
        seq.messages.append({"role": "assistant", "content": text})
        return text

    def observation_ids(self, seq: MaskedSequence, new_messages: list[Message]) -> list[int]:
        """Glue + observation delta + next generation prompt, tokenized once (not yet appended)."""
        sampled = _last_sampled_run(seq)
        glue = self.close_glue(sampled, seq.last_stop_reason)
        # Render the new messages after a short fixed context ending in this turn's assistant message,
        # not after the whole conversation: the cost per turn stays constant as episodes grow. A template
        # whose rendering of the new messages depends on older history shows up in the drift check.
        context = [*_PROBE, seq.messages[-1]] if seq.messages[-1]["role"] == "assistant" else seq.messages
        before = self.render(context, add_generation_prompt=False)
        after = self.render([*context, *new_messages], add_generation_prompt=True)
        if after.startswith(before):
            delta = after[len(before) :]
        else:
            cut = _common_prefix_len(before, after)
            delta = after[cut:]
            seq.notes.append(
                f"turn {sum(1 for m in seq.messages if m['role'] == 'assistant')}: the template is not append-only "
                f"at this observation (renderings diverge at char {cut}: {before[cut : cut + 40]!r} vs "
                f"{after[cut : cut + 40]!r})"
            )
        return self.encode(glue + delta)

    def add_observation(self, seq: MaskedSequence, new_messages: list[Message], ids: list[int]) -> None:
        seq.append_forced(ids)
        seq.messages.extend(dict(m) for m in new_messages)
        seq.ends_in_generation_prompt = True

    # --- drift -------------------------------------------------------------------------------------------

    def check_drift(self, seq: MaskedSequence, warn: bool = True) -> DriftReport:
        """Compare the ids with a full re-render of `seq.messages`; report, never fix."""
        if seq.ends_in_generation_prompt:
            text = self.render(seq.messages, add_generation_prompt=True)
            ours = list(seq.token_ids)
        else:
            # The rendering closes the last assistant turn; the sequence stops at what was sampled.
            text = self.render(seq.messages, add_generation_prompt=False)
            tail = self.close_glue(_last_sampled_run(seq), seq.last_stop_reason)
            ours = list(seq.token_ids) + self.encode(tail)
        rendered = self.encode(text)
        first = next((i for i, (a, b) in enumerate(zip(ours, rendered, strict=False)) if a != b), None)
        if first is None and len(ours) != len(rendered):
            first = min(len(ours), len(rendered))
        report = DriftReport(rendered_len=len(rendered))
        if first is not None or seq.notes:
            ours_text = self.decode(ours)
            kind = "tokenization" if ours_text == text and not seq.notes else "template"
            notes = list(seq.notes)
            if "\ufffd" in ours_text:
                # Sampled bytes that are not valid UTF-8 decode to U+FFFD: the text the env saw is lossy.
                notes.append("the policy sampled byte tokens that do not decode as UTF-8 (shown as U+FFFD)")
            where = ""
            if first is not None:
                where = (
                    f"first differing id at {first} (ours {ours[first : first + 6]} = "
                    f"{self.decode(ours[first : first + 6])!r}, re-render {rendered[first : first + 6]} = "
                    f"{self.decode(rendered[first : first + 6])!r}); "
                )
            report = DriftReport(
                drifted=True,
                first_mismatch=first if first is not None else min(len(ours), len(rendered)),
                rendered_len=len(rendered),
                detail=f"{kind}: {where}{'; '.join(notes)}".rstrip("; "),
                kind=kind,
            )
        with _metrics_lock:
            DRIFT_METRICS["drift/checked"] += 1
            if report.drifted:
                DRIFT_METRICS[f"drift/{report.kind}"] += 1
        if report.drifted:
            log.info("token drift against the chat template: %s", report.detail)
            if warn:
                warnings.warn(
                    f"token ids drift from a re-render of the chat template: {report.detail}", stacklevel=2
                )
        return report


def _last_sampled_run(seq: MaskedSequence) -> list[int]:
    """The ids of the last turn the policy sampled (the trailing run of mask 1)."""
    i = len(seq.loss_mask)
    while i > 0 and seq.loss_mask[i - 1] == 1:
        i -= 1
    return seq.token_ids[i:]


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
