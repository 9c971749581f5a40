"""xgrammar's errors, said in our words.

xgrammar raises RuntimeErrors carrying its C++ log line (time stamp, source file and line, at
times a failed check's condition). A user sees none of that: `user_message()` names what is
wrong from a table of the reasons xgrammar gives, keeps the position of a syntax error when it
points into the user's own text (a regex, a grammar), and says less when it knows less.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

_REGEX_AT = re.compile(r"Regex parsing error at position (\d+)")
_EBNF_AT = re.compile(r"EBNF (?:parser|lexer) error at line (\d+), column (\d+)")
_RULE = re.compile(r'Rule "(\w{1,40})"')
# (what xgrammar says, what we say); the first that matches wins
_REASONS: list[tuple[re.Pattern, str]] = [
    (re.compile(p, re.I), ours)
    for p, ours in [
        (r"Unclosed '\['", "a '[' is not closed"),
        (r"parenthesis is not closed|Expect \)", "a '(' is not closed"),
        (r"Unmatched '\)'", "a ')' closes nothing"),
        (r"Escape sequence is not finished|Invalid escape", "an escape sequence is unknown or cut"),
        (r"Lookahead|Lookbehind", "lookarounds are not supported"),
        (r"Backreference", "backreferences are not supported"),
        (r"Unicode character class", r"\p{...} character classes are not supported"),
        (r"Invalid repetition count", "a repetition count {m,n} is not two numbers"),
        (r"Lower bound is larger than upper bound", "a repetition {m,n} has m > n"),
        (r"Invalid character class", "a character range runs backwards"),
        (r"null characters", "it contains a NUL character"),
        (r"is not defined", "the rule {rule} is not defined"),
        (r'rule with name "root" is not found', "it has no rule named root"),
        (r"defined multiple times", "the rule {rule} is defined twice"),
        (r"Nest layer exceeded", "its parentheses nest too deep"),
        (r'Expect " in string literal', "a string is not closed"),
        (r"Expect element|Expect ", "an expression is missing or malformed"),
        (r"Token id \d+", "a Token(...) id is outside the vocabulary"),
        (r"Unsupported type", "a type is not one of JSON's"),
        (r"Integer exceeds", "an integer bound is outside the 64-bit range"),
        (
            r"must be an integer|must not exceed",
            "a count (minItems, maxLength, ...) is not an integer from 0 to 2^31 - 1",
        ),
        (r"cannot accept any value|additional items are not allowed", "no value satisfies it"),
        (
            r"minimum greater than maximum|empty range|is greater than",
            "its bounds leave no value (a minimum above its maximum)",
        ),
        (r"enum array must not be empty", "an enum is empty"),
        (r"Circular \$ref", "a $ref cycle holds no schema"),
        (r"Cannot find field", "a $ref does not resolve inside it"),
        (r"must be an? |should be an? ", "a keyword has a value of the wrong type"),
    ]
]


def user_message(name: str, error: Exception) -> str:
    """`error` from xgrammar about a constraint (`name`: "regex", "grammar", "JSON schema"),
    as a message for the user: 'invalid regex: a '[' is not closed (at position 6)'. A
    position is kept only where it is in the user's own text: not in a pattern inside a
    schema, nor in the grammar xgrammar made of a regex."""
    text = str(error)
    reason = next((ours for pattern, ours in _REASONS if pattern.search(text)), None)
    if reason is None:
        logger.info("xgrammar refused a %s with an unmapped error: %s", name, text.strip())
        reason = "xgrammar cannot turn it into a grammar"
    rule = _RULE.search(text)
    reason = reason.replace("{rule}", repr(rule.group(1)) if rule else "it names")
    return f"invalid {name}: {reason}{_position(name, text)}"


def _position(name: str, text: str) -> str:
    at = _REGEX_AT.search(text)
    if at is not None and name == "regex":
        return f" (at position {at.group(1)})"
    at = _EBNF_AT.search(text)
    if at is not None and name == "grammar":
        return f" (at line {at.group(1)}, column {at.group(2)})"
    return ""
