"""Stop strings on the host (:mod:`jspec.engine.stop_strings`): the match that completes
first wins, a string spanning tokens or ending inside a multi-byte character is found, a
possible start of a stop string is held back while streaming (never streamed, then
retracted), and bad stop strings are refused."""

import pytest

from jspec.engine.stop_strings import (TextStream, check_stop, first_match, held,
                                       match_tokens)
from jspec.tokenizer import Llama2cTokenizer


def byte_tokenizer():
    """A real byte-fallback tokenizer: ids 3..258 are the bytes 0x00..0xFF."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
    return Llama2cTokenizer(pieces, [0.0] * len(pieces))


def ids_of(text: str) -> list[int]:
    return [3 + b for b in text.encode()]


def test_check_stop():
    tok = byte_tokenizer()
    assert check_stop(None, "r", None) == ()
    assert check_stop("ab", "r", tok) == ("ab",)
    assert check_stop(["a", "bc"], "r", tok) == ("a", "bc")
    with pytest.raises(ValueError, match="request r: an empty stop string"):
        check_stop(["a", ""], "r", tok)
    with pytest.raises(ValueError, match="must be str"):
        check_stop([3], "r", tok)
    with pytest.raises(ValueError, match="tokenizer"):
        check_stop(["a"], "r", None)


def test_first_match_is_the_first_to_complete():
    assert first_match("hello world", ["xyz"]) is None
    assert first_match("hello world", ["world", "lo"]) == (3, 5)
    # "abcd" starts first but "c" completes first: the stream would have stopped at "c".
    assert first_match("abcd", ["abcd", "c"]) == (2, 3)
    # Both complete at the same character: the one that starts first (the longer) wins.
    assert first_match("xab", ["b", "ab"]) == (1, 3)


def test_held_is_the_longest_possible_start():
    assert held("hello\n", ["\n\n"]) == 1
    assert held("hello", ["\n\n"]) == 0
    assert held("say ab", ["abc", "b!"]) == 2           # "ab" could start "abc"
    assert held("say a", ["abc", "b!"]) == 1
    assert held("abc", []) == 0


def test_text_stream_holds_back_and_never_retracts():
    ts = TextStream(["END"])
    out = [ts.step("the E"), ts.step("the EN"), ts.step("the ENd"), ts.step("the ENd and E")]
    assert out == ["the ", "", "ENd", " and "]
    assert ts.step("the ENd and E", final=True) == "E"
    plain = TextStream()
    assert plain.step("ab") == "ab" and plain.step("abc") == "c"


def test_match_spanning_tokens_keeps_the_completing_token():
    tok = byte_tokenizer()
    ids = ids_of("one two three")
    # "two" completes at its "o", token 7: the tokens keep it, the text stops before "two".
    assert match_tokens(tok, ids, 0, ["two"]) == (7, "one ")
    assert match_tokens(tok, ids, 0, ["four"]) is None
    assert match_tokens(tok, ids, 0, ["three", "o t"]) == (9, "one tw")   # completes first


def test_stop_string_inside_a_multibyte_character():
    tok = byte_tokenizer()
    ids = ids_of("café!")                     # é is two bytes: tokens 3 and 4
    assert len(ids) == 6
    # The first byte of é alone decodes to a replacement character: no match, and nothing
    # of it is streamed.
    assert match_tokens(tok, ids[:4], 0, ["é"]) is None
    assert match_tokens(tok, ids, 0, ["é"]) == (5, "caf")
    assert match_tokens(tok, ids, 0, ["é!"]) == (6, "caf")
    ts = TextStream(["é!"])
    assert ts.step(tok.decode(ids[:4]).rstrip("\ufffd")) == "caf"
    assert ts.step(tok.decode(ids[:5]).rstrip("\ufffd")) == ""       # "é" held back
    # A stop string whose last character is the incomplete one matches once it completes.
    assert match_tokens(tok, ids_of("naïve"), 0, ["aï"]) == (4, "n")
