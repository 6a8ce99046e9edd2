"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Phi-3,
Gemma) as a `tokenizers` BPE with byte fallback.

A GGUF stores the pieces (`tokenizer.ggml.tokens`), one score per piece and one llama.cpp token type
per piece; merges only sometimes. SentencePiece's BPE joins, at each step, the adjacent pair whose
joined piece ranks best, so a merge list ranked by the joined piece is the same algorithm. The rank is
the piece's score, except for Gemma, whose scores put its user-defined whitespace pieces ("  ",
score -1000) last although they merge first; there the order of the pieces in the file is the rank
(what transformers' GGUF converter does too).

Text is normalized as SentencePiece does for these models: spaces become "▁", and with
`tokenizer.ggml.add_space_prefix` (default true, as in llama.cpp) a "▁" is put in front of the text
and of every piece of text that follows a control or user-defined token, as llama.cpp does. The
decoder undoes both: "▁" -> " ", <0xNN> byte pieces -> bytes, and the one leading space dropped.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as RustTokenizer

from kiln.models.config import ModelLoadError

# llama.cpp's llama_token_type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"  # "▁", SentencePiece's visible space
# architectures whose merges follow the order of the pieces in the file rather than their scores
_RANK_BY_POSITION = ("gemma", "gemma2", "gemma3", "gemma3n")


def sentencepiece_tokenizer(
    meta: dict[str, Any],
    tokens: list[str],
    types: list[int],
    merges: list[tuple[str, str]] | None,
    source: str,
) -> RustTokenizer:
    """A `tokenizers.Tokenizer` for a GGUF SentencePiece vocabulary: BPE (byte_fallback) over the
    pieces, merges from `tokenizer.ggml.merges` or derived from the scores, the normalizer and decoder
    described in the module docstring, control tokens (type 3) as special added tokens and
    user-defined ones (type 4) as plain added tokens. tokens / types: one entry per token id;
    merges: the file's (checked), None when it has none. ModelLoadError on malformed scores."""
    arch = meta.get("general.architecture")
    pieces = [_respell_spaces(t) if types[i] != _CONTROL else t for i, t in enumerate(tokens)]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if merges is None:
        merges = derive_merges(pieces, types, _piece_ranks(meta, len(tokens), arch, source))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    try:
        tok = RustTokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
    except Exception as exc:  # the Rust library raises plain Exceptions (a merge of unknown pieces)
        raise ModelLoadError(
            f"{source}: cannot build the SentencePiece BPE from its metadata ({exc})"
        ) from exc

    add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(add_space_prefix, bool):
        raise ModelLoadError(
            f"{source}: metadata key 'tokenizer.ggml.add_space_prefix' is {add_space_prefix!r}, "
            "expected a bool"
        )
    to_visible_space = normalizers.Replace(" ", _SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), to_visible_space])
        if add_space_prefix
        else to_visible_space
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    # Matched whole in the raw text before normalization. A user-defined piece that was respelled
    # ("  " -> "▁▁") is left to the BPE: the normalizer has turned the spaces it would match into "▁".
    tok.add_tokens(
        [
            AddedToken(t, special=types[i] == _CONTROL, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] == _CONTROL or (types[i] == _USER_DEFINED and pieces[i] == t)
        ]
    )
    return tok


def derive_merges(pieces: list[str], types: list[int], ranks: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces, best
    first. pieces / types / ranks: one entry per token id; a higher rank merges earlier. Ties go to the
    longer left part, then the longer right part, then the earlier piece in the file. Control and
    byte pieces take no part: text must never merge into "<bos>" or into a "<0x41>" piece that
    decodes as "A"."""
    mergeable = {p for p, kind in zip(pieces, types, strict=True) if kind not in (_CONTROL, _BYTE)}
    found = []
    for index, piece in enumerate(pieces):
        if piece not in mergeable or types[index] in (_CONTROL, _BYTE):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                found.append((-ranks[index], -cut, cut - len(piece), index, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _piece_ranks(meta: dict[str, Any], count: int, arch: Any, source: str) -> list[float]:
    """Merge rank of each piece: its score, or minus its position for the architectures in
    _RANK_BY_POSITION and for files without scores."""
    scores = meta.get("tokenizer.ggml.scores")
    if arch in _RANK_BY_POSITION or scores is None:
        return [-float(i) for i in range(count)]
    if (
        not isinstance(scores, list)
        or len(scores) != count
        or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)
    ):
        raise ModelLoadError(
            f"{source}: metadata key 'tokenizer.ggml.scores' is not a list of one number per token"
        )
    return [float(s) for s in scores]


def _respell_spaces(token: str) -> str:
    """A piece of real spaces (Gemma stores its runs of spaces so) as the "▁"s the normalizer makes."""
    return _SPACE * len(token) if token and not token.strip(" ") else token
