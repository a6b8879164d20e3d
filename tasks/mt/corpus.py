"""A deterministic English -> German translation corpus generated inside the project.

The default MT task needs no download: sentences about numbers, dates, clock times and counted
objects are generated from a seeded random stream and translated by rule. The rules exercise what
makes translation more than word substitution:

- word order: German numbers put units before tens ("twenty one" -> "ein und zwanzig"), dates
  put the day before the month, and a fronted time or date adjunct moves the verb before the
  subject (verb-second: "at half past seven i see ..." -> "um halb acht sehe ich ...");
- agreement: article and adjective endings follow the noun's gender and number in the accusative
  ("one red table" -> "einen roten tisch", "one red lamp" -> "eine rote lampe", "three red
  books" -> "drei rote bücher"), ordinals take the dative ending after "am";
- non-compositional phrases: "half past seven" -> "halb acht", "quarter to eight" ->
  "viertel vor acht".

German numbers are written with their components separated by spaces ("drei hundert ein und
zwanzig" rather than "dreihunderteinundzwanzig") so that word-level BLEU gives partial credit.

`write_corpus(data_dir)` writes `{train,dev,test}.src` (English) and `.tgt` (German), one sentence
per line; the splits hold distinct source sentences.
"""

from __future__ import annotations

import os
import random

__all__ = [
    "generate",
    "number_de",
    "number_en",
    "ordinal_de_dative",
    "ordinal_en",
    "sentence_pair",
    "split_paths",
    "SPLITS",
    "write_corpus",
    "year_de",
    "year_en",
]

SPLITS = ("train", "dev", "test")
DEFAULT_SIZES = {"train": 30000, "dev": 500, "test": 500}
SOURCE_SUFFIX = "src"
TARGET_SUFFIX = "tgt"

_EN_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
             "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
             "seventeen", "eighteen", "nineteen"]
_EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_DE_UNITS = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun",
             "zehn", "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn",
             "achtzehn", "neunzehn"]
_DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig",
            "neunzig"]
_EN_ORDINAL_UNITS = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh",
                     "eighth", "ninth", "tenth", "eleventh", "twelfth", "thirteenth",
                     "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth",
                     "nineteenth"]
_DE_ORDINAL_IRREGULAR = {1: "ersten", 3: "dritten", 7: "siebten", 8: "achten"}
_MONTHS = [("january", "januar"), ("february", "februar"), ("march", "märz"),
           ("april", "april"), ("may", "mai"), ("june", "juni"), ("july", "juli"),
           ("august", "august"), ("september", "september"), ("october", "oktober"),
           ("november", "november"), ("december", "dezember")]
_MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
# (english singular, english plural, german singular, german plural, gender)
_NOUNS = [
    ("table", "tables", "tisch", "tische", "m"), ("dog", "dogs", "hund", "hunde", "m"),
    ("chair", "chairs", "stuhl", "stühle", "m"), ("apple", "apples", "apfel", "äpfel", "m"),
    ("key", "keys", "schlüssel", "schlüssel", "m"),
    ("lamp", "lamps", "lampe", "lampen", "f"), ("cat", "cats", "katze", "katzen", "f"),
    ("flower", "flowers", "blume", "blumen", "f"), ("bag", "bags", "tasche", "taschen", "f"),
    ("door", "doors", "tür", "türen", "f"),
    ("book", "books", "buch", "bücher", "n"), ("house", "houses", "haus", "häuser", "n"),
    ("car", "cars", "auto", "autos", "n"), ("picture", "pictures", "bild", "bilder", "n"),
    ("window", "windows", "fenster", "fenster", "n"),
]
_ADJECTIVES = [("red", "rot"), ("blue", "blau"), ("green", "grün"), ("old", "alt"),
               ("new", "neu"), ("big", "groß"), ("small", "klein"), ("black", "schwarz"),
               ("white", "weiß"), ("beautiful", "schön")]
# (english subject + verb, german subject, german verb)
_SUBJECTS = [("i see", "ich", "sehe"), ("she buys", "sie", "kauft"), ("we need", "wir", "brauchen"),
             ("he has", "er", "hat"), ("they sell", "sie", "verkaufen"),
             ("you find", "du", "findest")]


def number_en(n: int) -> str:
    """English words of 0 <= n < 10000: 'three hundred twenty one'."""
    if not 0 <= n < 10000:
        raise ValueError(f"number_en: n must be in [0, 10000), got {n}.")
    if n < 20:
        return _EN_UNITS[n]
    if n < 100:
        tens, units = divmod(n, 10)
        return _EN_TENS[tens] + (f" {_EN_UNITS[units]}" if units else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_EN_UNITS[hundreds]} hundred" + (f" {number_en(rest)}" if rest else "")
    thousands, rest = divmod(n, 1000)
    return f"{_EN_UNITS[thousands]} thousand" + (f" {number_en(rest)}" if rest else "")


def _de_below_100(n: int, final: bool) -> str:
    if n == 1:
        return "eins" if final else "ein"
    if n < 20:
        return _DE_UNITS[n]
    tens, units = divmod(n, 10)
    if not units:
        return _DE_TENS[tens]
    unit = "ein" if units == 1 else _DE_UNITS[units]
    return f"{unit} und {_DE_TENS[tens]}"


def number_de(n: int) -> str:
    """German words of 0 <= n < 10000, components spaced: 'drei hundert ein und zwanzig'."""
    if not 0 <= n < 10000:
        raise ValueError(f"number_de: n must be in [0, 10000), got {n}.")
    if n == 0:
        return "null"
    parts = []
    thousands, rest = divmod(n, 1000)
    if thousands:
        parts.append(f"{_de_below_100(thousands, final=False)} tausend")
    hundreds, rest = divmod(rest, 100)
    if hundreds:
        parts.append(f"{_de_below_100(hundreds, final=False)} hundert")
    if rest:
        parts.append(_de_below_100(rest, final=True))
    return " ".join(parts)


def ordinal_en(n: int) -> str:
    """English ordinal of 1 <= n <= 31: 'twenty first', 'thirtieth'."""
    if n < 20:
        return _EN_ORDINAL_UNITS[n]
    tens, units = divmod(n, 10)
    if not units:
        return _EN_TENS[tens][:-1] + "ieth"
    return f"{_EN_TENS[tens]} {_EN_ORDINAL_UNITS[units]}"


def ordinal_de_dative(n: int) -> str:
    """German dative ordinal after 'am' of 1 <= n <= 31: 'ersten', 'ein und zwanzigsten'."""
    if n in _DE_ORDINAL_IRREGULAR:
        return _DE_ORDINAL_IRREGULAR[n]
    if n < 20:
        return _DE_UNITS[n] + "ten"
    return _de_below_100(n, final=False) + "sten"


def year_en(y: int) -> str:
    """English year as spoken: 'nineteen eighty four', 'two thousand five', 'nineteen oh two'."""
    if 2000 <= y < 2010:
        return number_en(y)
    century, rest = divmod(y, 100)
    if rest == 0:
        return f"{number_en(century)} hundred"
    if rest < 10:
        return f"{number_en(century)} oh {number_en(rest)}"
    return f"{number_en(century)} {number_en(rest)}"


def year_de(y: int) -> str:
    """German year: 'neunzehn hundert vier und achtzig', 'zwei tausend fünf'."""
    if y >= 2000:
        return number_de(y)
    century, rest = divmod(y, 100)
    return f"{number_de(century)} hundert" + (f" {_de_below_100(rest, True)}" if rest else "")


def _date(rng: random.Random) -> tuple[str, str]:
    month = rng.randrange(12)
    day = rng.randint(1, _MONTH_DAYS[month])
    en_month, de_month = _MONTHS[month]
    return (f"on {en_month} {ordinal_en(day)}", f"am {ordinal_de_dative(day)} {de_month}")


def _time(rng: random.Random) -> tuple[str, str]:
    hour = rng.randint(1, 12)
    nxt = hour % 12 + 1
    kind = rng.randrange(5)
    if kind == 0:
        return f"at {number_en(hour)} o'clock", f"um {number_de(hour)} uhr"
    if kind == 1:
        return f"at half past {number_en(hour)}", f"um halb {number_de(nxt)}"
    if kind == 2:
        return f"at quarter past {number_en(hour)}", f"um viertel nach {number_de(hour)}"
    if kind == 3:
        return f"at quarter to {number_en(nxt)}", f"um viertel vor {number_de(nxt)}"
    minutes = rng.choice([5, 10, 20, 25, 35, 40, 50, 55])
    return (f"at {number_en(hour)} {number_en(minutes)}",
            f"um {number_de(hour)} uhr {number_de(minutes)}")


def _object(rng: random.Random) -> tuple[str, str]:
    """An accusative noun phrase with a count and an optional adjective."""
    en_sg, en_pl, de_sg, de_pl, gender = rng.choice(_NOUNS)
    adjective = rng.choice(_ADJECTIVES) if rng.random() < 0.7 else None
    count = 1 if rng.random() < 0.4 else rng.choice([rng.randint(2, 12), rng.randint(13, 999)])
    if count == 1:
        article = {"m": "einen", "f": "eine", "n": "ein"}[gender]
        ending = {"m": "en", "f": "e", "n": "es"}[gender]
        en = ["one"] + ([adjective[0]] if adjective else []) + [en_sg]
        de = [article] + ([adjective[1] + ending] if adjective else []) + [de_sg]
    else:
        en = [number_en(count)] + ([adjective[0]] if adjective else []) + [en_pl]
        de = [number_de(count)] + ([adjective[1] + "e"] if adjective else []) + [de_pl]
    return " ".join(en), " ".join(de)


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One (english, german) pair drawn from `rng`."""
    kind = rng.random()
    if kind < 0.15:
        n = rng.choice([rng.randint(0, 99), rng.randint(100, 9999)])
        return number_en(n), number_de(n)
    if kind < 0.25:
        y = rng.randint(1900, 2029)
        day_en, day_de = _date(rng)
        return f"{day_en} , {year_en(y)}", f"{day_de} {year_de(y)}"
    en_subject, de_subject, de_verb = rng.choice(_SUBJECTS)
    obj_en, obj_de = _object(rng)
    if kind < 0.55:
        return f"{en_subject} {obj_en}", f"{de_subject} {de_verb} {obj_de}"
    adjunct_en, adjunct_de = _time(rng) if rng.random() < 0.5 else _date(rng)
    # Verb-second: the fronted adjunct pushes the subject after the verb.
    return (f"{adjunct_en} {en_subject} {obj_en}",
            f"{adjunct_de} {de_verb} {de_subject} {obj_de}")


def generate(sizes: dict[str, int] | None = None, seed: int = 0
             ) -> dict[str, list[tuple[str, str]]]:
    """Split -> list of (english, german) pairs; splits have disjoint source sentences.

    Pairs are drawn from one seeded stream until enough distinct sources exist, shuffled with the
    same seed and cut into the splits in the order train, dev, test.
    """
    sizes = dict(DEFAULT_SIZES if sizes is None else sizes)
    for split, n in sizes.items():
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"corpus.generate: sizes[{split!r}] must be an int >= 0, got {n!r}.")
    total = sum(sizes.values())
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    attempts = 0
    while len(seen) < total:
        attempts += 1
        if attempts > 50 * total + 1000:
            raise ValueError(f"corpus.generate: cannot draw {total} distinct sentences; ask "
                             "for smaller sizes.")
        en, de = sentence_pair(rng)
        seen.setdefault(en, de)
    pairs = list(seen.items())
    rng.shuffle(pairs)
    out, start = {}, 0
    for split in SPLITS:
        n = sizes.get(split, 0)
        out[split] = pairs[start:start + n]
        start += n
    return out


def split_paths(data_dir: str, split: str) -> tuple[str, str]:
    """(source file, target file) of `split` in `data_dir`: `<split>.src`, `<split>.tgt`."""
    return (os.path.join(data_dir, f"{split}.{SOURCE_SUFFIX}"),
            os.path.join(data_dir, f"{split}.{TARGET_SUFFIX}"))


def _write_atomic(path: str, lines: list[str]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(tmp, path)


def write_corpus(data_dir: str, sizes: dict[str, int] | None = None, seed: int = 0) -> bool:
    """Writes the generated corpus into `data_dir` unless all its files exist.

    Returns True if the files were written. Each file is written to a temporary name and renamed,
    so concurrent callers never see a partial file.
    """
    paths = [p for split in SPLITS for p in split_paths(data_dir, split)]
    if all(os.path.exists(p) for p in paths):
        return False
    os.makedirs(data_dir, exist_ok=True)
    corpus = generate(sizes, seed)
    for split in SPLITS:
        src_path, tgt_path = split_paths(data_dir, split)
        _write_atomic(src_path, [en for en, _ in corpus[split]])
        _write_atomic(tgt_path, [de for _, de in corpus[split]])
    return True
