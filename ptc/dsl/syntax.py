"""Step one of the DSL: text -> AST, with syntax errors in plain words.

The grammar (`ptc/grammar.lark`, package data) is parsed with lark's LALR
parser, which gives the exact set of tokens acceptable at an error, so the
message can say "expected '=' after key 'layers'" instead of listing lark's
terminal names. A post-lexer drops newlines inside brackets (calls may span
lines) and bounds bracket nesting, so the recursive tree walk below can
never exhaust the Python stack.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ptc.dsl import ast
from ptc.dsl.source import Source

MAX_NESTING = 32
"""Deepest bracket nesting accepted; real plans use two or three levels."""

INT_LIMIT = 2**63
"""Integers must lie in (-2**63, 2**63): every count in a plan fits in 64 bits."""

_OPENERS = {"LPAR": "(", "LSQB": "["}
_CLOSERS = {"RPAR": ")", "RSQB": "]"}

# What each terminal is called in messages. `_NL` is lark's name for our
# newline token; `$END` is lark's end of input.
_WORDS = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string",
    "UNIT": "a unit", "EQUAL": "'='", "DOTDOT": "'..'", "COMMA": "','", "LBRACE": "'{'",
    "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'",
    "SEMICOLON": "';'", "_NL": "a new line", "$END": "the end of the file",
}
_VALUE_START = {"INT", "FLOAT", "STRING", "NAME", "LPAR", "LSQB"}


class _TooDeep(Exception):
    """Raised by the post-lexer at a bracket nested deeper than MAX_NESTING."""

    def __init__(self, token: Token):
        super().__init__("too deep")
        self.token = token


class _BracketPostLexer:
    """Drops newlines inside (...) and [...], and bounds their nesting.

    Python joins lines the same way inside brackets. Depth lives in the
    generator's locals, so one shared instance serves concurrent parses.
    """

    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        for token in stream:
            if token.type in _OPENERS:
                depth += 1
                if depth > MAX_NESTING:
                    raise _TooDeep(token)
            elif token.type in _CLOSERS:
                depth = max(0, depth - 1)
            elif token.type == "_NL" and depth:
                continue
            yield token


def _grammar_text() -> str:
    try:
        return resources.files("ptc").joinpath("grammar.lark").read_text(encoding="utf-8")
    except (OSError, TypeError, ModuleNotFoundError):  # e.g. an unusual loader
        return (Path(__file__).resolve().parent.parent / "grammar.lark").read_text(encoding="utf-8")


@functools.cache
def _parser() -> Lark:
    # Built once per process (about 50 ms); lark's LALR parse is re-entrant.
    return Lark(_grammar_text(), parser="lalr", lexer="contextual",
                propagate_positions=True, postlex=_BracketPostLexer(), maybe_placeholders=False)


def parse_syntax(source: Source) -> ast.PlanFile | None:
    """Parse `source.text` into a `PlanFile`; on a syntax error record it and return None.

    Literal problems (an integer too large, a float that overflows) are
    recorded too, and their nodes become `ast.Invalid`.
    """
    try:
        tree = _parser().parse(source.text)
    except _TooDeep as exc:
        source.error(f"brackets nested more than {MAX_NESTING} deep", _token_pos(exc.token))
        return None
    except UnexpectedInput as exc:
        message, pos = _describe_syntax_error(exc, source)
        source.error(message, pos)
        return None
    except (LarkError, RecursionError) as exc:  # not expected; still a plan error
        source.error(f"cannot parse the plan: {exc}", source.end_pos())
        return None
    return _Builder(source).plan_file(tree)


# --------------------------------------------------------------- tree -> AST


def _token_pos(token: Token) -> ast.Pos:
    line = token.line or 1
    column = token.column or 1
    return ast.Pos(line, column, token.end_line or line, token.end_column or column + 1)


def _tree_pos(tree: Tree) -> ast.Pos:
    meta = tree.meta
    if getattr(meta, "empty", True):
        return ast.Pos(1, 1, 1, 2)
    return ast.Pos(meta.line, meta.column, meta.end_line, meta.end_column)


class _Builder:
    """Walks lark's tree and builds AST nodes; reports bad literals to `source`."""

    def __init__(self, source: Source):
        self.source = source

    def plan_file(self, tree: Tree) -> ast.PlanFile:
        sections = tuple(self.section(child) for child in tree.children
                         if isinstance(child, Tree))
        return ast.PlanFile(sections=sections, end=self.source.end_pos())

    def section(self, tree: Tree) -> ast.Section:
        keyword, *rest = tree.children
        argument: ast.Name | ast.Str | None = None
        items: list[ast.Item] = []
        for child in rest:
            if isinstance(child, Token):
                pos = _token_pos(child)
                argument = (self.string(child, pos) if child.type == "STRING"
                            else ast.Name(str(child), pos))
            else:
                items.append(self.item(child))
        kw_pos = _token_pos(keyword)
        header_end = argument.pos if argument is not None else kw_pos
        # The section's position is its header: that is where "missing key"
        # errors point, not at the closing brace many lines below.
        pos = ast.Pos(kw_pos.line, kw_pos.column, header_end.end_line, header_end.end_column)
        return ast.Section(keyword=str(keyword), keyword_pos=kw_pos, argument=argument,
                           items=tuple(items), pos=pos)

    def item(self, tree: Tree) -> ast.Item:
        if tree.data == "assign":
            key, value = tree.children
            return ast.Assign(key=str(key), key_pos=_token_pos(key), value=self.value(value))
        keyword, pattern, word = tree.children
        pattern_node = self.string(pattern, _token_pos(pattern))
        return ast.Directive(keyword=str(keyword), keyword_pos=_token_pos(keyword),
                             pattern=pattern_node, word=ast.Name(str(word), _token_pos(word)))

    def value(self, node: Tree) -> ast.Value:
        kind, children, pos = node.data, node.children, _tree_pos(node)
        if kind in ("int", "float"):
            return self.number(children[0], pos)
        if kind == "quantity":
            number, unit = children
            num = self.number(number, _token_pos(number))
            if isinstance(num, ast.Invalid):
                return num
            return ast.Quantity(number=num, unit=str(unit), unit_pos=_token_pos(unit), pos=pos)
        if kind == "string":
            return self.string(children[0], pos)
        if kind == "name":
            return ast.Name(str(children[0]), pos)
        if kind == "range":
            start, _, stop = children
            lo, hi = self.number(start, _token_pos(start)), self.number(stop, _token_pos(stop))
            if isinstance(lo, ast.Invalid) or isinstance(hi, ast.Invalid):
                return ast.Invalid(pos)
            return ast.Range(start=lo.value, stop=hi.value, pos=pos)
        if kind == "call":
            name, *rest = children
            args: list[ast.Value] = []
            kwargs: list[ast.KwArg] = []
            for child in rest:
                if isinstance(child, Tree) and child.data == "kwarg":
                    key, value = child.children
                    if isinstance(key, Tree):  # a call as the key
                        call = self.value(Tree("call", key.children, key.meta))
                        kwargs.append(ast.KwArg(key=call.name, key_pos=call.pos,
                                                value=self.value(value), key_call=call))
                        continue
                    kwargs.append(ast.KwArg(key=str(key), key_pos=_token_pos(key),
                                            value=self.value(value)))
                elif child is not None:
                    args.append(self.value(child))
            return ast.Call(name=str(name), name_pos=_token_pos(name), args=tuple(args),
                            kwargs=tuple(kwargs), pos=pos)
        items = tuple(self.value(c) for c in children if c is not None)
        return ast.Tuple(items, pos) if kind == "tuple" else ast.List(items, pos)

    def number(self, token: Token, pos: ast.Pos) -> ast.Int | ast.Float | ast.Invalid:
        text = str(token)
        if token.type == "INT":
            digits = text.lstrip("-").replace("_", "")
            # Checking the length first keeps int() away from Python's
            # 4300-digit limit on huge literals.
            value = int(text) if len(digits) <= 19 else INT_LIMIT
            if abs(value) >= INT_LIMIT:
                self.source.error(f"integer {_short(text)} is too large "
                                  f"(integers must be below 2**63)", pos)
                return ast.Invalid(pos)
            return ast.Int(value, pos)
        value = float(text)
        if not math.isfinite(value):
            self.source.error(f"number {_short(text)} is too large to represent", pos)
            return ast.Invalid(pos)
        return ast.Float(value, pos)

    def string(self, token: Token, pos: ast.Pos) -> ast.Str:
        return ast.Str(unescape(str(token)[1:-1]), pos)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}


def unescape(body: str) -> str:
    """Decode the escapes of a string literal's body: \\\\ \\" \\n \\t \\r \\uXXXX \\UXXXXXXXX.

    An unknown escape stays as written, so a Windows path like
    "C:\\data" keeps its backslash.
    """
    if "\\" not in body:
        return body
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\" or i + 1 >= len(body):
            out.append(ch)
            i += 1
            continue
        nxt = body[i + 1]
        width = {"u": 4, "U": 8}.get(nxt, 0)
        hexdigits = body[i + 2:i + 2 + width]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif width and len(hexdigits) == width and all(c in "0123456789abcdefABCDEF"
                                                         for c in hexdigits) \
                and int(hexdigits, 16) <= 0x10FFFF:
            out.append(chr(int(hexdigits, 16)))
            i += 2 + width
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _short(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------- syntax errors


def _describe_syntax_error(exc: UnexpectedInput, source: Source) -> tuple[str, ast.Pos]:
    """A plain-words message and position for a lark syntax error."""
    expected = _expected(exc)
    if isinstance(exc, UnexpectedToken) and exc.token.type != "$END":
        token = exc.token
        pos = _token_pos(token)
        what = _describe_token(token)
    elif isinstance(exc, UnexpectedToken):
        pos = source.end_pos()
        what = "end of file"
    else:
        line, column = exc.line, exc.column
        pos = ast.Pos(line, column, line, column + 1)
        char = exc.char if isinstance(exc, UnexpectedCharacters) else "?"
        what = "unterminated string" if char == '"' else f"character {char!r}"
    message = f"unexpected {what}"
    if expected:
        message += f"; expected {expected}"
    hint = _hint(exc, source, pos)
    if hint:
        message += f" ({hint})"
    return message, pos


def _expected(exc: UnexpectedInput) -> str:
    names: set[str] = set()
    parser = getattr(exc, "interactive_parser", None)
    try:
        names = set(parser.accepts()) if parser is not None else set()
    except (LarkError, RecursionError, AttributeError):
        names = set()
    if not names:
        names = set(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    if names - {"UNIT", "DOTDOT"}:
        # A unit or '..' can follow any number; naming them in every
        # "expected" list would drown the likelier fix.
        names -= {"UNIT", "DOTDOT"}
    words: list[str] = []
    if _VALUE_START <= names:
        words.append("a value")
        names -= _VALUE_START
    if names == {"EQUAL", "STRING"}:  # `key` then something: the '=' is missing
        names = {"EQUAL"}
    order = list(_WORDS)
    words += [_WORDS.get(n, n) for n in sorted(names, key=lambda n: (order.index(n)
                                                                    if n in order else 99, n))]
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def _describe_token(token: Token) -> str:
    text = _short(str(token))
    if token.type in ("NAME", "UNIT"):
        return f"name '{text}'"
    if token.type in ("INT", "FLOAT"):
        return f"number {text}"
    if token.type == "STRING":
        return f"string {text}"
    if token.type == "_NL":
        return "end of line"
    return f"'{text}'"


def _hint(exc: UnexpectedInput, source: Source, pos: ast.Pos) -> str:
    """A likely cause, from the brackets still open where the error is."""
    opened = _open_brackets(source.text, pos)
    token = getattr(exc, "token", None)
    char = getattr(exc, "char", None)
    if token is not None and token.type == "LBRACE" and any(b == "{" for b, _, _ in opened):
        line = next(ln for b, ln, _ in reversed(opened) if b == "{")
        return f"is the '}}' of the section opened at line {line} missing?"
    if opened and ((token is not None and token.type == "$END")
                   or (opened[-1][0] != "{" and opened[-1][1] < pos.line)):
        # At the end of the file, or a bracket left open on an earlier line:
        # the unclosed bracket is the likely mistake, not this token.
        bracket, line, column = opened[-1]
        closer = {"{": "}", "(": ")", "[": "]"}[bracket]
        return f"the '{bracket}' at line {line}, column {column} is never closed with '{closer}'"
    if char == "-":
        return 'a name with "-" is written as a string, e.g. gpu = "H100-SXM"'
    if token is not None and token.type == "NAME" and str(token)[:1].isdigit():
        return "write a space between a number and its unit, e.g. 80 GiB"
    return ""


def _open_brackets(text: str, pos: ast.Pos) -> list[tuple[str, int, int]]:
    """The brackets opened and not yet closed before `pos`, as (bracket, line, column).

    A small scan that skips strings and comments; run only after an error.
    """
    stack: list[tuple[str, int, int]] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    line, column, i = 1, 1, 0
    in_string = in_comment = False
    while i < len(text) and (line, column) < (pos.line, pos.column):
        ch = text[i]
        if ch == "\n":
            in_string = in_comment = False
            line, column = line + 1, 0
        elif in_comment:
            pass
        elif in_string:
            if ch == "\\":
                i += 1
                column += 1
            elif ch == '"':
                in_string = False
        elif ch == "#":
            in_comment = True
        elif ch == '"':
            in_string = True
        elif ch in "([{":
            stack.append((ch, line, column))
        elif ch in pairs and stack and stack[-1][0] == pairs[ch]:
            stack.pop()
        i += 1
        column += 1
    return stack
