"""Incremental detokenization: output text that grows token by token, and stop-string matching.

Decoding each new token alone breaks words (SentencePiece drops the leading space of a piece
decoded on its own) and characters (a UTF-8 character can span byte-level tokens). So, like vLLM,
keep two offsets into the ids: text is emitted as decode(ids[prefix:]) minus decode(ids[prefix:read]),
and held back while it ends in U+FFFD, the mark of an incomplete multi-byte character.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens to decode in front of the output, for the first pieces' spacing


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop: bool = False,
    ):
        """stop: strings that end the text, cut just before the first one to appear (include_stop:
        just after it; of stop strings completed by the same tokens at the same character, the first in
        the list)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # The context window may start inside a byte-fallback character (SentencePiece <0xNN> pieces):
        # decoded, that partial character would turn the whole run into U+FFFD; start after it.
        while self.prefix_offset < self.read_offset and self._decode(
            self.ids[self.prefix_offset : self.read_offset]
        ).startswith(_REPLACEMENT):
            self.prefix_offset += 1
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop
        # False while the request's min_tokens keeps stop strings from ending it: new text is not searched
        # (once True, a stop string that starts in earlier text and ends in the new one still counts)
        self.search_stops = True
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_tokens(self, token_ids: list[int], final: bool = False) -> bool:
        """Append output tokens; returns True when a stop string matched (the text is cut before it).
        final=True flushes an incomplete trailing character instead of holding it back."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return False
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._append(delta)

    def _append(self, delta: str) -> bool:
        start = max(0, len(self.text) - self.max_stop_len + 1)  # a match may straddle old and new text
        self.text += delta
        if not self.stop or not self.search_stops:
            return False
        hits = [(i, n) for n, i in enumerate(self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            index, which = min(hits)
            self.text = self.text[: index + (len(self.stop[which]) if self.include_stop else 0)]
            return True
        return False


def stop_prefix_length(text: str, stop: list[str] | None) -> int:
    """How many characters at the end of `text` begin one of the stop strings (without completing it):
    what a stream holds back until later tokens complete the stop string (the text is cut there) or
    rule it out, so that streamed text equals the final text."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for s in stop or ():
        n = min(len(s) - 1, len(text))
        while n > longest:  # only lengths whose last character is the text's (C-level scans)
            n = s.rfind(last, 0, n) + 1
            if n <= longest:
                break
            if text.endswith(s[:n]):
                longest = n
                break
            n -= 1
    return longest
