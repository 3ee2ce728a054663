"""A tiny trained French-to-English translator of number words, shipped for demos.

The checkpoint in ``model/`` is a MarianMT model (the architecture of the opus-mt models) trained
by ``scripts/train_demo_model.py`` to translate French number words for 0..9999 into English, e.g.
"deux cent quarante-trois" -> "two hundred forty-three". The converters below define the task.

French follows the traditional spelling: hyphens only below one hundred ("vingt et un",
"quatre-vingt-dix-sept"), "cents" and "quatre-vingts" take an s only when they end the number,
"mille" never does. English is American style, without "and":
"one thousand nine hundred eighty-four".
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from onnxmerge.errors import InvalidArgumentError

__all__ = [
    "DEMO_MODEL_DIR",
    "DEMO_SENTENCES",
    "LARGEST_NUMBER",
    "english_number",
    "french_number",
    "is_held_out",
]

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / "model"

LARGEST_NUMBER = 9999

# 243, 97 and 71 are in the training data; 1984, 5671 and 8180 were held out from it.
DEMO_SENTENCES: tuple[str, ...] = (
    "deux cent quarante-trois",
    "quatre-vingt-dix-sept",
    "mille neuf cent quatre-vingt-quatre",
    "soixante et onze",
    "cinq mille six cent soixante et onze",
    "huit mille cent quatre-vingts",
)

_FRENCH_UNITS = (
    "zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf",
    "dix", "onze", "douze", "treize", "quatorze", "quinze", "seize",
)  # fmt: skip
_FRENCH_TENS = {2: "vingt", 3: "trente", 4: "quarante", 5: "cinquante", 6: "soixante"}

_ENGLISH_UNITS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen",
)  # fmt: skip
_ENGLISH_TENS = {
    2: "twenty", 3: "thirty", 4: "forty", 5: "fifty",
    6: "sixty", 7: "seventy", 8: "eighty", 9: "ninety",
}  # fmt: skip


def is_held_out(n: int) -> bool:
    """Whether ``n`` was kept out of the training data, so the model never saw its sentence.

    About one number in ten from 100 up is held out, chosen by a hash so the split is pseudo-random
    yet fixed. Everything below 100 is trained on: those are the building blocks of the rest.
    """
    _check_range(n)
    return n >= 100 and hashlib.sha256(b"onnxmerge-demo:%d" % n).digest()[0] < 26


def _check_range(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"expected an int, got {type(n).__name__}", argument="n")
    if not 0 <= n <= LARGEST_NUMBER:
        raise InvalidArgumentError(
            f"{n} is outside 0..{LARGEST_NUMBER}, the range the demo covers", argument="n"
        )


def _french_below_100(n: int) -> str:
    if n <= 16:
        return _FRENCH_UNITS[n]
    if n < 20:
        return "dix-" + _FRENCH_UNITS[n - 10]
    if n < 70:
        tens, unit = _FRENCH_TENS[n // 10], n % 10
        if unit == 0:
            return tens
        if unit == 1:
            return tens + " et un"
        return tens + "-" + _FRENCH_UNITS[unit]
    if n < 80:
        # 70..79 count on from sixty: soixante-dix, soixante et onze, soixante-douze...
        return "soixante et onze" if n == 71 else "soixante-" + _french_below_100(n - 60)
    if n == 80:
        # Within 0..9999 eighty always ends the number, so it always takes its plural s.
        return "quatre-vingts"
    return "quatre-vingt-" + _french_below_100(n - 80)


def _french_below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if hundreds == 0:
        return _french_below_100(rest)
    head = "cent" if hundreds == 1 else _FRENCH_UNITS[hundreds] + " cent"
    if rest == 0:
        return head + ("s" if hundreds > 1 else "")
    return head + " " + _french_below_100(rest)


def french_number(n: int) -> str:
    """French words for ``n`` in 0..9999: 1980 -> "mille neuf cent quatre-vingts"."""
    _check_range(n)
    thousands, rest = divmod(n, 1000)
    if thousands == 0:
        return _french_below_1000(rest)
    head = "mille" if thousands == 1 else _FRENCH_UNITS[thousands] + " mille"
    return head if rest == 0 else head + " " + _french_below_1000(rest)


def _english_below_100(n: int) -> str:
    if n < 20:
        return _ENGLISH_UNITS[n]
    tens, unit = divmod(n, 10)
    return _ENGLISH_TENS[tens] + ("-" + _ENGLISH_UNITS[unit] if unit else "")


def _english_below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if hundreds == 0:
        return _english_below_100(rest)
    head = _ENGLISH_UNITS[hundreds] + " hundred"
    return head if rest == 0 else head + " " + _english_below_100(rest)


def english_number(n: int) -> str:
    """English words for ``n`` in 0..9999: 1984 -> "one thousand nine hundred eighty-four"."""
    _check_range(n)
    thousands, rest = divmod(n, 1000)
    if thousands == 0:
        return _english_below_1000(rest)
    head = _ENGLISH_UNITS[thousands] + " thousand"
    return head if rest == 0 else head + " " + _english_below_1000(rest)
