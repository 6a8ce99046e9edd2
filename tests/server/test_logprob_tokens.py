"""How logprobs show tokens, without a model: a token that is part of a UTF-8 character gets its own
bytes from its vocabulary piece (byte-level BPE, SentencePiece <0xNN>), never U+FFFD's; a top_logprobs
map keeps the most likely entry of a text; -inf and NaN logprobs are written as -9999.0."""

from __future__ import annotations

import json

from kiln.server import protocol
from kiln.server.serving import token_text_and_bytes


class PieceTokenizer:
    """decode and id_to_token over a fixed table of (vocabulary piece, bytes the decoder makes)."""

    def __init__(self, pieces: dict[int, tuple[str, bytes]]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True) -> str:
        return b"".join(self.pieces[i][1] for i in ids).decode("utf-8", errors="replace")

    def id_to_token(self, token_id):
        return self.pieces[token_id][0]


TOKENS = PieceTokenizer(
    {
        1: ("<0xE7>", b"\xe7"),  # SentencePiece byte fallback
        2: ("ç", b"\xe7"),  # byte-level BPE: GPT-2's alphabet spells byte 0xE7 "ç"
        3: ("Ġå¥", b" \xe5\xa5"),  # a space and two of a character's three bytes
        4: ("hello", b"hello"),
        5: ("ï¿½", "\ufffd".encode()),  # the token that is U+FFFD itself
        6: ("▁world", b" world"),  # a SentencePiece piece: its text as the tokenizer decodes it
    }
)


def test_a_part_of_a_character_shows_its_own_bytes():
    assert token_text_and_bytes(TOKENS, 1) == ("bytes:\\xe7", b"\xe7")
    assert token_text_and_bytes(TOKENS, 2) == ("bytes:\\xe7", b"\xe7")
    assert token_text_and_bytes(TOKENS, 3) == ("bytes: \\xe5\\xa5", b" \xe5\xa5")
    assert token_text_and_bytes(TOKENS, 4) == ("hello", b"hello")
    assert token_text_and_bytes(TOKENS, 5) == ("\ufffd", "\ufffd".encode())
    assert token_text_and_bytes(TOKENS, 6) == (" world", b" world")


def test_chat_shows_such_a_token_without_the_bytes_prefix_and_with_its_bytes():
    entry = protocol.LogprobEntry("bytes:\\xe7", b"\xe7", -0.5, [("bytes:\\xe7", b"\xe7", -0.5)])
    (content,) = protocol.chat_logprobs([entry])["content"]
    assert content["token"] == "\\xe7" and content["bytes"] == [0xE7]
    assert content["top_logprobs"] == [{"token": "\\xe7", "logprob": -0.5, "bytes": [0xE7]}]
    text = protocol.LogprobEntry("bytes:x", b"bytes:x", -0.5, [])  # valid text that starts so: kept
    assert protocol.chat_logprobs([text])["content"][0]["token"] == "bytes:x"


def test_top_logprobs_keep_the_most_likely_entry_of_a_text_and_write_no_infinity():
    top = [("", b"", -0.1), ("a", b"a", -1.0), ("", b"", -2.0), ("b", b"b", float("-inf"))]
    entry = protocol.LogprobEntry("", b"", -0.1, top)
    body = protocol.completion_logprobs([entry], [0])
    assert body["top_logprobs"] == [{"": -0.1, "a": -1.0, "b": -9999.0}]
    nan = protocol.LogprobEntry("a", b"a", float("nan"), [])
    assert protocol.completion_logprobs([nan], [0])["token_logprobs"] == [-9999.0]
    json.dumps(body, allow_nan=False)  # strict JSON
