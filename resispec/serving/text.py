"""Prompt encoding and incremental detokenisation with stop strings, shared by both endpoints and the tests.

Streamed and non-streamed responses are built by the same `TextAssembler`, so the streamed deltas always
reassemble to the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence

# The chat fallback for tokenizers without a chat template (e.g. the embedded world's BPE tokenizer): one line per
# message, "<role>: <content>", then "assistant:" for the model to continue.
FALLBACK_CHAT_SEPARATOR = "\n"


def fallback_chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """[(role, text), ...] -> "system: ...\\nuser: ...\\nassistant:" (the documented fallback template)."""
    lines = [f"{role}: {text}" for role, text in messages]
    return FALLBACK_CHAT_SEPARATOR.join(lines + ["assistant:"])


def encode_text(tokenizer, text: str) -> list[int]:
    """A completion prompt string -> ids, exactly as the server encodes it (special tokens such as BOS added)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(
    tokenizer, messages: Sequence[tuple[str, str]], template_kwargs: dict | None = None
) -> list[int]:
    """Chat messages -> prompt ids: the tokenizer's chat template (with data.chat_template_kwargs, e.g. Qwen3's
    enable_thinking) when it has one, else the fallback."""
    if getattr(tokenizer, "chat_template", None):
        dicts = [{"role": role, "content": text} for role, text in messages]
        text = tokenizer.apply_chat_template(
            dicts, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template carries BOS itself
    return encode_text(tokenizer, fallback_chat_prompt(messages))


def decode_ids(tokenizer, ids: Sequence[int]) -> str:
    """Generated ids -> text, as the server renders it (special tokens such as EOS dropped)."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class TextAssembler:
    """Turns generated token chunks into text deltas.

    Holds back (a) a trailing U+FFFD, which is an incomplete multi-byte character of a byte-level BPE, and (b) any
    tail that could still grow into a stop string. A stop string ends the text before it (OpenAI semantics).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.text = ""  # the decoded text, cut at a stop string once one appears
        self.stopped = False  # a stop string was found

    def add(self, chunk: Sequence[int]) -> str:
        """New token ids -> the text now safe to send (possibly "")."""
        if self.stopped:
            return ""
        self.ids.extend(chunk)
        self.text = decode_ids(self.tokenizer, self.ids)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._release(len(self.text))
        safe = len(self.text)
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        safe -= self._partial_stop(self.text[:safe])
        return self._release(safe)

    def finish(self) -> str:
        """The rest of the text at the end of the generation."""
        return self._release(len(self.text))

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta
