"""Property: for ANY input text, parse returns a Plan or raises a PtcError.

Three generators: random text over the language's characters (and any
unicode), random mutations of the example files, and random but
well-formed sections built from the real keys with values of every kind.
Besides "only PtcError escapes", every diagnostic must point inside the
file and must not be the internal-error safety net of `ptc.dsl.parse`.
"""

from __future__ import annotations

import os
import re

from dsl_helpers import EXAMPLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptc.dsl import parse
from ptc.dsl.schema import SECTIONS
from ptc.errors import PlanError, PtcError
from ptc.plan import Plan

# A fixed, small budget keeps the suite fast and repeatable. For a deeper,
# random search run with e.g. PTC_FUZZ_EXAMPLES=5000.
_DEEP = int(os.environ.get("PTC_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_DEEP or 100, deadline=None, derandomize=not _DEEP,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TEXTS = [p.read_text() for p in EXAMPLES]


def check_outcome(text: str) -> None:
    """parse(text) is a Plan or a well-formed PtcError; nothing else."""
    lines = text.removeprefix("\ufeff").split("\n")
    try:
        plan = parse(text, "fuzz.ptc")
    except PlanError as exc:
        assert exc.diagnostics, "a PlanError must carry at least one diagnostic"
        str(exc)  # rendering must not fail either
        for d in exc.diagnostics:
            assert "internal error" not in d.message, d.message
            assert d.span is not None, d.render()
            assert 1 <= d.span.line <= len(lines) and d.span.column >= 1, d.render()
        return
    except PtcError:
        return
    assert isinstance(plan, Plan)


# ------------------------------------------------------------ random text

LANGUAGE_CHARS = "{}()[]=,;.\"#\\-_ \t\n\r0123456789eE+abcdefgluGiBsTFLOP/"


@FUZZ
@given(st.text(alphabet=st.sampled_from(LANGUAGE_CHARS), max_size=200)
       | st.text(max_size=100))
def test_random_text(text: str) -> None:
    check_outcome(text)


# -------------------------------------------------------------- mutations

TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|-?\d[\w.]*|\w+|[^\s\w]|\s+')
NUMBER = re.compile(r"-?\d[\d_]*(\.\d+)?([eE][+-]?\d+)?")
NASTY_NUMBERS = ["99999999999999999999999999", "9" * 5000, "-1", "-0", "0", "1e999", "1e-999",
                 "2.5", "1_000_000_000_000", "9223372036854775807", "9223372036854775808",
                 "0..3", "10 GB", "4 GiB/s", "3 ms", "1e308 TB"]
INSERTS = [" GB", " ms", " TFLOP/s", " Gb/s", " parsecs", "{", "}", "(", ")", "[", "]", ",",
           "=", ";", "\n", '"', "#", "..", "none", "auto", "-", "\\", "\x00", "\u00e9",
           "((((((((((((((((((((((((((((((((((((((("]

mutation = st.one_of(
    st.tuples(st.just("delete_chars"), st.integers(0, 10**6), st.integers(1, 20)),
    st.tuples(st.just("duplicate_chars"), st.integers(0, 10**6), st.integers(1, 40)),
    st.tuples(st.just("swap_chars"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("delete_token"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("duplicate_token"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("swap_tokens"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("replace_number"), st.integers(0, 10**6),
              st.integers(0, len(NASTY_NUMBERS) - 1)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, len(INSERTS) - 1)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
)


def mutate(text: str, kind: str, a: int, b: int) -> str:
    """Apply one mutation; positions are taken modulo the text's length."""
    n = max(len(text), 1)
    tokens = TOKEN.findall(text)
    t = max(len(tokens), 1)
    if kind == "delete_chars":
        i = a % n
        return text[:i] + text[i + b:]
    if kind == "duplicate_chars":
        i = a % n
        return text[:i + b] + text[i:]
    if kind == "swap_chars" and text:
        i, j = sorted((a % n, b % n))
        return text[:i] + text[j] + text[i + 1:j] + text[i] + text[j + 1:] if i < j else text
    if kind == "delete_token":
        return "".join(tokens[:a % t] + tokens[a % t + 1:])
    if kind == "duplicate_token":
        return "".join(tokens[:a % t + 1] + tokens[a % t:])
    if kind == "swap_tokens" and len(tokens) > 1:
        i = a % (len(tokens) - 1)
        tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
        return "".join(tokens)
    if kind == "replace_number":
        numbers = list(NUMBER.finditer(text))
        if not numbers:
            return text
        m = numbers[a % len(numbers)]
        return text[:m.start()] + NASTY_NUMBERS[b] + text[m.end():]
    if kind == "insert":
        i = a % n
        return text[:i] + INSERTS[b] + text[i:]
    if kind == "truncate":
        return text[:a % n]
    return text


@FUZZ
@given(st.sampled_from(range(len(TEXTS))), st.lists(mutation, min_size=1, max_size=4))
def test_mutated_examples(index: int, mutations: list[tuple[str, int, int]]) -> None:
    text = TEXTS[index]
    for kind, a, b in mutations:
        text = mutate(text, kind, a, b)
    check_outcome(text)


# ----------------------------------------------- well-formed random plans

NAMES = sorted({k for keys in SECTIONS.values() for k in keys} | {
    "gpt", "llama", "auto", "none", "true", "false", "bf16", "fp32", "gelu", "full", "selective",
    "1f1b", "gpipe", "interleaved", "tp", "dp", "pp", "cpu", "custom", "rollback", "adamw",
    "cosine", "tokens", "random", "link", "flops", "layers", "bogus"})
UNITS = ["GB", "GiB", "B", "GB/s", "Gb/s", "TFLOP/s", "us", "ms", "min", "h", "furlong"]


def values(depth: int = 2) -> st.SearchStrategy[str]:
    """Plan-language value texts of every kind, nested up to `depth`."""
    scalars = st.one_of(
        st.integers(0, 130).map(str),  # small counts reach the cross-section checks
        st.integers(-(2**70), 2**70).map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.tuples(st.integers(0, 10**6), st.sampled_from(UNITS)).map(lambda p: f"{p[0]} {p[1]}"),
        st.sampled_from(NAMES),
        st.text(max_size=8).map(lambda s: '"' + s.replace("\\", "").replace('"', "")
                                .replace("\n", "") + '"'),
        st.tuples(st.integers(-3, 200), st.integers(-3, 200)).map(lambda p: f"{p[0]}..{p[1]}"),
    )
    if depth == 0:
        return scalars
    inner = values(depth - 1)
    return st.one_of(
        scalars,
        st.lists(inner, max_size=4).map(lambda xs: "(" + ", ".join(xs) + ")"),
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.tuples(st.sampled_from(NAMES), st.lists(
            st.tuples(st.sampled_from(NAMES), inner), max_size=4)).map(
            lambda p: f"{p[0]}(" + ", ".join(f"{k} = {v}" for k, v in p[1]) + ")"),
    )


section = st.tuples(
    st.sampled_from([*SECTIONS, "modle"]),
    st.sampled_from(["", "gpt", "llama", '"pkg.mod:make"', "bogus"]),
    st.lists(st.tuples(st.sampled_from(NAMES), values(depth=1)), max_size=8),
)


def render(sec: tuple[str, str, list[tuple[str, str]]]) -> str:
    name, arg, items = sec
    body = "".join(f"  {k} = {v}\n" for k, v in items)
    return f"{name} {arg} {{\n{body}}}\n".replace("  {", " {")


@FUZZ
@given(st.lists(section, min_size=1, max_size=5))
def test_random_well_formed_sections(sections: list) -> None:
    check_outcome("\n".join(render(s) for s in sections))


def set_key(text: str, key: str, value: str) -> str:
    """`text` with `key` set to `value` in the section that owns the key
    (its existing line replaced, or a new line added before the section's '}')."""
    line = re.search(rf"^  {key} = .*$", text, flags=re.M)
    if line:
        return text[:line.start()] + f"  {key} = {value}" + text[line.end():]
    home = next(name for name, keys in SECTIONS.items() if key in keys)
    header = re.search(rf"^{home}\b.*\{{$", text, flags=re.M)
    if not header:
        return text + f"\n{home} {{\n  {key} = {value}\n}}\n"
    close = text.index("\n}", header.end())
    return text[:close] + f"\n  {key} = {value}" + text[close:]


ALL_KEYS = sorted({k for keys in SECTIONS.values() for k in keys})


@FUZZ
@given(st.sampled_from(range(len(TEXTS))),
       st.lists(st.tuples(st.sampled_from(ALL_KEYS), values(depth=1)), min_size=1, max_size=3))
def test_examples_with_keys_set_to_anything(index: int, changes: list[tuple[str, str]]) -> None:
    # Setting real keys to random values keeps the file well formed and
    # reaches the converters, the section checks and the cross-section
    # checks, which character-level mutations rarely get past.
    text = TEXTS[index]
    for key, value in changes:
        text = set_key(text, key, value)
    check_outcome(text)
