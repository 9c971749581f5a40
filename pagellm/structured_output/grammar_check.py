"""Checks on the grammar xgrammar parsed, before it is compiled against a vocabulary: that it
matches some string at all, that no choice has more alternatives than the limit, and (for an
EBNF grammar) that its counted repetitions stay under the limit when nested through rules.

The grammar is read from xgrammar's own serialized form (`Grammar.serialize_json()`): rules
(name, body expression), and expressions as `[type, length, data...]` in one flat array. The
analysis is sound in one direction only: an expression type it does not model (tag dispatch,
token sets, regex and substring macros) counts as matching something, so a valid grammar is
never refused; a serialization version it does not know skips the checks (with a warning).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.structured_output.limits import over_limit, regex_repetition

if TYPE_CHECKING:
    from pagellm.config import StructuredOutputsConfig

logger = logging.getLogger(__name__)

# xgrammar's GrammarExprType (cpp/grammar_impl.h), the same in these serialization versions
KNOWN_VERSIONS = frozenset({"v16", "v17", "v18"})
BYTES, CLASS, CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)
REGEX = 12  # [json_string flag, pattern bytes...]
MAX_CODEPOINT = 0x10FFFF
_warned: set[str] = set()


@dataclass
class GrammarView:
    """A parsed grammar's rules and expressions, from its serialized form."""

    names: list[str]  # rule names, by rule id
    bodies: list[int]  # each rule's body expression id
    exprs: list[tuple[int, list[int]]]  # (type, data) by expression id
    root: int

    @classmethod
    def load(cls, serialized: str) -> GrammarView | None:
        """None when the serialization version is not one this module knows."""
        doc = json.loads(serialized)
        version = doc.get("__VERSION__")
        if version not in KNOWN_VERSIONS:
            if version not in _warned:
                _warned.add(version)
                logger.warning("xgrammar serialization %s is unknown: grammars unchecked", version)
            return None
        data, starts = doc["grammar_expr_data"], doc["grammar_expr_indptr"]
        exprs = [(data[a], data[a + 2 : b]) for a, b in zip(starts, [*starts[1:], len(data)])]
        rules = doc["rules"]
        return cls([r[0] for r in rules], [r[1] for r in rules], exprs, doc["root_rule_id"])


def check_grammar(serialized: str, kind: str, name: str, limits: StructuredOutputsConfig) -> None:
    """ValueError if the grammar has a choice with too many alternatives, (EBNF) nested
    repetitions over the limit, or matches no string at all. `name` says what it is in the
    message ("grammar", "JSON schema", ...)."""
    view = GrammarView.load(serialized)
    if view is None:
        return
    widest = max((len(d) for t, d in view.exprs if t == CHOICES), default=0)
    if widest > limits.max_enum_values:
        over_limit(f"the {name} has a choice of {widest} alternatives", "max_enum_values", limits)
    if kind == "grammar":
        product = repetition_product(view)
        if product > limits.max_repetition:
            message = f"the {name} nests counted repetitions {{m,n}} {product} times over"
            over_limit(message, "max_repetition", limits)
    if not productive_rules(view)[view.root]:
        raise ValueError(
            f"invalid {name}: it matches no string (its rule {view.names[view.root]!r} never "
            "comes to an end)"
        )


def productive_rules(view: GrammarView) -> list[bool]:
    """Which rules derive some finite string: the least fixed point over the AND (sequence) /
    OR (choices) graph of expressions and rules, by a work list (linear in the grammar)."""
    num_exprs = len(view.exprs)
    # nodes: expressions 0..num_exprs-1, then rules; `needs`: how many children an AND node
    # still waits for (an OR node needs one), `parents`: who to tell when a node is productive
    needs = [1] * (num_exprs + len(view.names))
    parents: list[list[int]] = [[] for _ in needs]
    ready: list[int] = []
    for i, (kind, data) in enumerate(view.exprs):
        children = _children(kind, data, num_exprs)
        if children is None:  # a leaf: matches a string or not
            if _leaf_matches(kind, data):
                ready.append(i)
            continue
        if kind == SEQUENCE:
            needs[i] = len(children)
            if not children:
                ready.append(i)
        for child in children:
            parents[child].append(i)
    for rule, body in enumerate(view.bodies):
        parents[body].append(num_exprs + rule)
    productive = [False] * len(needs)
    while ready:
        node = ready.pop()
        if productive[node]:
            continue
        productive[node] = True
        for parent in parents[node]:
            needs[parent] -= 1
            if needs[parent] == 0:
                ready.append(parent)
    return productive[num_exprs:]


def _children(kind: int, data: list[int], num_exprs: int) -> list[int] | None:
    """The nodes an expression derives from (rules as num_exprs + id); None for a leaf."""
    if kind in (SEQUENCE, CHOICES):
        return data
    if kind == RULE_REF:
        return [num_exprs + data[0]]
    if kind == REPEAT and data[1] > 0:  # [rule, min, max]: at least one of the rule
        return [num_exprs + data[0]]
    return None


def _leaf_matches(kind: int, data: list[int]) -> bool:
    """Whether a leaf matches some string; what is not modelled here is taken to."""
    if kind == CLASS:  # [negated, lo0, hi0, lo1, hi1, ...]
        ranges = sorted(zip(data[1::2], data[2::2]))
        if not data[0]:
            return any(lo <= hi for lo, hi in ranges)
        covered = -1  # the negation matches a code point no range covers
        for lo, hi in ranges:
            if lo > covered + 1:
                return True
            covered = max(covered, hi)
        return covered < MAX_CODEPOINT
    return True


def repetition_product(view: GrammarView) -> int:
    """The largest product of the counts of repetitions nested in one another, through rule
    references and regex macros (a reference back to a rule being visited counts once)."""
    num_exprs = len(view.exprs)
    best: dict[int, int] = {}  # node -> its largest product, once known
    on_path: set[int] = set()
    stack: list[tuple[int, bool]] = [(view.root + num_exprs, False)]
    while stack:
        node, expanded = stack.pop()
        if node in best:
            continue
        edges = _weighted_edges(view, node)
        if not expanded:
            on_path.add(node)
            stack.append((node, True))
            stack.extend((child, False) for child, _ in edges if child not in on_path)
            continue
        on_path.discard(node)
        own = _own_product(view, node)
        best[node] = max([own, *(weight * best.get(child, 1) for child, weight in edges)])
    return best[view.root + num_exprs]


def _weighted_edges(view: GrammarView, node: int) -> list[tuple[int, int]]:
    num_exprs = len(view.exprs)
    if node >= num_exprs:
        return [(view.bodies[node - num_exprs], 1)]
    kind, data = view.exprs[node]
    if kind in (SEQUENCE, CHOICES):
        return [(child, 1) for child in data]
    if kind == RULE_REF:
        return [(num_exprs + data[0], 1)]
    if kind == REPEAT:  # [rule, min, max]; max -1: unbounded (counted up to min)
        return [(num_exprs + data[0], max(data[2] if data[2] >= 0 else data[1], 1))]
    return []


def _own_product(view: GrammarView, node: int) -> int:
    """A regex macro's own nested repetitions (its pattern's bytes)."""
    if node >= len(view.exprs) or view.exprs[node][0] != REGEX:
        return 1
    pattern = bytes(view.exprs[node][1][1:]).decode("utf-8", "replace")
    return regex_repetition(pattern)
