"""Incremental detokenizer: multi-byte characters split over tokens, stop strings across tokens."""

from kiln.engine.detokenizer import IncrementalDetokenizer, stop_prefix_length


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255), like the byte fallback of BPE tokenizers; 256 = EOS."""

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stream(text, stop=None, prompt="Q: ", include_stop=False):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop, include_stop)
    seen = []
    ids = tok.encode(text)
    for i, token in enumerate(ids):
        stopped = detok.add_tokens([token], final=i == len(ids) - 1)
        seen.append(detok.text)
        if stopped:
            return detok.text, seen, True
    return detok.text, seen, False


def test_multibyte_characters_split_across_tokens_never_show_replacement_chars():
    text = "héllo, 世界 🙂!"
    final, seen, _ = stream(text)
    assert final == text
    assert all("\ufffd" not in t for t in seen)
    assert all(text.startswith(t) for t in seen)  # text only ever grows by whole characters


def test_stop_string_spanning_tokens_truncates_text_before_it():
    final, _, stopped = stream("The answer is 42.\nUser: more", stop=["\nUser:"])
    assert stopped and final == "The answer is 42."


def test_earliest_of_several_stop_strings_wins():
    final, _, stopped = stream("abc STOP def END", stop=["END", "STOP"])
    assert stopped and final == "abc "


def test_include_stop_keeps_the_stop_string_that_ended_the_text():
    """vLLM's include_stop_str_in_output: the text ends just after the stop string that completed."""
    final, _, stopped = stream("The answer is 42.\nUser: more", stop=["\nUser:"], include_stop=True)
    assert stopped and final == "The answer is 42.\nUser:"
    final, _, stopped = stream("abc STOP def END", stop=["END", "STOP"], include_stop=True)
    assert stopped and final == "abc STOP"
    final, _, _ = stream("abc STOP def", stop=["STOP", "ST"], include_stop=True)
    assert final == "abc ST"  # one byte a token: "ST" is complete first
    final, _, stopped = stream("né 世界", stop=["世"], include_stop=True)  # a stop across bytes
    assert stopped and final == "né 世"


def test_no_stop_string_keeps_the_whole_text():
    final, _, stopped = stream("nothing to see", stop=["zzz"])
    assert not stopped and final == "nothing to see"


def test_stop_prefix_length_is_the_longest_unfinished_start_of_a_stop_string():
    assert stop_prefix_length("1. Ban", ["anan"]) == 2  # "an" may become "anan"
    assert stop_prefix_length("1. Bana", ["anan", "a!"]) == 3  # "ana" beats "a"
    assert stop_prefix_length("list:\n", ["\n2."]) == 1
    assert stop_prefix_length("abc", ["abc"]) == 0  # a whole stop string is the detokenizer's to cut
    assert stop_prefix_length("xyz", ["abc"]) == 0
    assert stop_prefix_length("ab", ["zabc"]) == 0
    assert stop_prefix_length("b", ["bcd", "b"]) == 1
    assert stop_prefix_length("anything", None) == stop_prefix_length("", ["ab"]) == 0
