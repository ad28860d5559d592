"""A character-level tokenizer with a fixed, documented vocabulary for Countdown.

ids: 0 <pad>, 1 <bos>, 2 <eos>, then one id per character of CHARS in order:
digits `0-9`, operators `+ - * /`, `( )`, space, `,`, `=`, `:`, `>`, `<`, `/` is shared with division,
and the letters of the answer tags (`a n s w e r`). Unknown characters are refused.
"""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+-*/() ,=:<>answer"
_SPECIAL = 3
_TO_ID = {c: i + _SPECIAL for i, c in enumerate(dict.fromkeys(CHARS))}
_TO_CHAR = {i: c for c, i in _TO_ID.items()}
VOCAB_SIZE = _SPECIAL + len(_TO_ID)


def encode(text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """Token ids of `text` (optionally with <bos>/<eos>); a character outside the vocabulary raises."""
    bad = sorted({c for c in text if c not in _TO_ID})
    if bad:
        raise ValueError(f"characters {bad} are not in the Countdown vocabulary {CHARS!r}")
    return ([BOS] if bos else []) + [_TO_ID[c] for c in text] + ([EOS] if eos else [])


def decode(ids) -> str:
    """Text of token ids; <pad>/<bos> are dropped and decoding stops at <eos>."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i in _TO_CHAR:
            out.append(_TO_CHAR[i])
    return "".join(out)
