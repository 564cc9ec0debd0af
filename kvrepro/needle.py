"""Passkey ("needle in a haystack") prompts and their scorer.

Task: a 5-digit pass key sits on its own line inside filler text; the model is asked for it.
The passkey task follows Mohtashami & Jaggi, "Landmark Attention", 2023 (arXiv:2305.16300):
same filler sentences and needle wording. For a 135M model the prompt is chat-templated
(haystack inside the user turn with the question and "Answer with the number only.") and the
assistant turn is primed with "The pass key is " (measured: REPRODUCTION-CARD.md, "The small
real model on CPU"), so the first generated token is the first key digit.

Rules every prompt obeys (``check_prompt``; field-faults.md row 11):
- the needle's token ids occur exactly once, and the key's digit ids occur only inside it;
- no special token (BOS/EOS/any ``all_special_ids``) inside the user content: the tokenizer's
  BOS id occurs only where the chat template opens a turn (SmolLM2's BOS *is* ``<|im_start|>``);
- the prompt depends only on (tokenizer, context_length, depth, key, wording), never on the KV
  format: ``sha256`` of the token ids is recorded so runs can be compared across formats.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
ANSWER_PRIME = "The pass key is "
KEY_DIGITS = 5
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class NeedlePrompt:
    """One passkey prompt.

    Attributes:
        input_ids: token ids of the whole prompt (chat template included), length ``n_tokens``.
        text: the prompt text ``input_ids`` encode.
        key: the pass key, a string of ``KEY_DIGITS`` digits.
        answer_ids: token ids of ``key`` as it follows ``ANSWER_PRIME`` (one id per digit for SmolLM2).
        context_length: the requested length (tokens); ``n_tokens <= context_length``.
        depth: requested needle depth in [0, 1] (0 = first line of the haystack, 1 = last).
        needle_start: index in ``input_ids`` of the needle's first token.
        sha256: hex SHA-256 of ``input_ids`` as little-endian int32 bytes.
    """

    input_ids: list[int] = field(repr=False)
    text: str = field(repr=False)
    key: str
    answer_ids: list[int]
    context_length: int
    depth: float
    needle_start: int
    sha256: str

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


def make_keys(num_keys: int, seed: int) -> list[str]:
    """``num_keys`` distinct 5-digit keys (no leading zero) from ``random.Random(seed)``."""
    if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < 1:
        raise ValueError(f"num_keys must be a positive integer, got {num_keys!r}")
    return [str(k) for k in random.Random(seed).sample(range(10_000, 100_000), num_keys)]


def ids_sha256(ids: list[int]) -> str:
    """Hex SHA-256 of token ids as little-endian int32 bytes."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)).hexdigest()


def find_subsequence(seq: list[int], sub: list[int]) -> list[int]:
    """Start indices of every occurrence of ``sub`` in ``seq``."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _render(tokenizer, haystack_lines: list[str]) -> str:
    user = INSTRUCTION + "\n\n" + "\n".join(haystack_lines) + "\n\n" + QUESTION
    head = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return head + ANSWER_PRIME


def _haystack(sentences: list[str], depth: float, needle: str) -> list[str]:
    at = round(depth * len(sentences))
    before, after = " ".join(sentences[:at]), " ".join(sentences[at:])
    return [x for x in (before, needle, after) if x]


def build_prompt(tokenizer, context_length: int, depth: float, key: str) -> NeedlePrompt:
    """Passkey prompt of at most ``context_length`` tokens (as close as whole filler sentences allow).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        context_length: target prompt length in tokens (template included), >= 128.
        depth: needle position in the haystack, 0.0 (first) .. 1.0 (last), by filler sentences.
        key: ``KEY_DIGITS`` digits, no leading zero.

    Raises:
        ValueError: bad ``context_length``, ``depth`` or ``key`` (naming it), or a rule of
            ``check_prompt`` broken.
    """
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 128:
        raise ValueError(f"context_length must be an integer >= 128 tokens, got {context_length!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    if not (isinstance(key, str) and re.fullmatch(rf"[1-9]\d{{{KEY_DIGITS - 1}}}", key)):
        raise ValueError(f"key must be a string of {KEY_DIGITS} digits without a leading zero, got {key!r}")
    needle = NEEDLE.format(key=key)
    fixed = len(_encode(tokenizer, _render(tokenizer, [needle])))
    per = [len(_encode(tokenizer, " " + s)) for s in FILLER]
    sentences: list[str] = []
    budget = context_length - fixed
    while budget > 0:
        i = len(sentences) % len(FILLER)
        if per[i] > budget:
            break
        sentences.append(FILLER[i])
        budget -= per[i]
    while True:  # joins may tokenize slightly differently: trim until it fits
        text = _render(tokenizer, _haystack(sentences, depth, needle))
        ids = _encode(tokenizer, text)
        if len(ids) <= context_length or not sentences:
            break
        sentences.pop()
    if len(ids) > context_length:
        raise ValueError(f"context_length={context_length} is too short for the prompt ({len(ids)} tokens)")
    answer_ids = _encode(tokenizer, key)
    needle_start = check_prompt(tokenizer, ids, needle, answer_ids)
    return NeedlePrompt(ids, text, key, answer_ids, context_length, float(depth), needle_start, ids_sha256(ids))


def check_prompt(tokenizer, ids: list[int], needle: str, answer_ids: list[int]) -> int:
    """Check the rules of the module docstring; return the needle's start index.

    Raises:
        ValueError: naming the broken rule.
    """
    needle_ids = _encode(tokenizer, needle)
    hits = find_subsequence(ids, needle_ids)
    if len(hits) != 1:
        raise ValueError(f"needle token ids occur {len(hits)} times in the prompt, expected exactly once")
    start, end = hits[0], hits[0] + len(needle_ids)
    outside = ids[:start] + [-1] + ids[end:]
    if find_subsequence(outside, answer_ids):
        raise ValueError("the key's token ids occur outside the needle")
    special = set(tokenizer.all_special_ids)
    user_open = find_subsequence(ids, _encode(tokenizer, INSTRUCTION))
    user_close = find_subsequence(ids, _encode(tokenizer, QUESTION))
    if len(user_open) != 1 or len(user_close) != 1:
        raise ValueError("instruction/question not found exactly once in the prompt")
    if any(t in special for t in ids[user_open[0]:user_close[0]]):
        raise ValueError("a special token (BOS/EOS) occurs inside the user content")
    bos = tokenizer.bos_token_id
    if bos is not None:
        for p in (i for i, t in enumerate(ids) if t == bos):
            if not tokenizer.decode(ids[p + 1:p + 4]).lstrip().startswith(ROLES):
                raise ValueError(f"BOS token at position {p} does not open a chat turn (BOS in mid-prompt)")
    return start


_NUMBER = re.compile(r"\d+")


def answer_decided(text: str) -> bool:
    """True once ``text`` holds a complete first number (digits followed by a non-digit), i.e. once
    ``score_answer`` can no longer change by generating more tokens."""
    return re.search(r"\d+\D", text) is not None


def score_answer(text: str, key: str) -> int:
    """1 if the first whole number in ``text`` equals ``key``, else 0.

    "48213", "The pass key is 48213.", "Sure, it's 48213." score 1 for key "48213";
    "4821", "482130" and "" score 0 (whole-number match, not substring).
    """
    m = _NUMBER.search(text)
    return int(m is not None and m.group(0) == key)
