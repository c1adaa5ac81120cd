"""All-pairs test cases: every value of every factor meets every value of every other factor in
at least one case, with far fewer cases than the full product.

Greedy and deterministic (the same factors give the same cases, in the same order): each new
case starts from the first pair still uncovered, then takes, factor by factor, the value that
covers the most uncovered pairs with the values chosen so far; ``allowed`` rules out
combinations that cannot run (a pair that no allowed case holds is simply not required).

Example:
    >>> cases = all_pairs({"a": [0, 1], "b": ["x", "y"], "c": [False, True]})
    >>> len(cases), cases[0]
    (4, {'a': 0, 'b': 'x', 'c': False})
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

Case = dict[str, Any]


def all_pairs(
    factors: dict[str, list[Any]], allowed: Callable[[Case], bool] = lambda case: True
) -> list[Case]:
    """Cases covering every allowed pair of values of two factors; see the module docstring."""
    names = list(factors)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }
    cases: list[Case] = []
    while uncovered:
        case = _best_case(
            factors, names, sorted(uncovered, key=_order(factors))[0], uncovered, allowed
        )
        if case is None:  # the first uncovered pair holds in no allowed case: not required
            uncovered.discard(sorted(uncovered, key=_order(factors))[0])
            continue
        cases.append(case)
        uncovered -= _pairs_of(case, names)
    return cases


def _order(factors: dict[str, list[Any]]) -> Callable[[tuple], tuple]:
    """Sort pairs by factor position, then value position: a stable, readable order."""
    position = {name: i for i, name in enumerate(factors)}

    def key(pair: tuple) -> tuple:
        (a, va), (b, vb) = pair
        return (position[a], factors[a].index(va), position[b], factors[b].index(vb))

    return key


def _pairs_of(case: Case, names: list[str]) -> set[tuple]:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}


def _best_case(
    factors: dict[str, list[Any]],
    names: list[str],
    seed: tuple,
    uncovered: set[tuple],
    allowed: Callable[[Case], bool],
) -> Case | None:
    """A case holding ``seed``, greedily covering the most other uncovered pairs, or None."""
    (a, va), (b, vb) = seed
    case: Case = {a: va, b: vb}
    for name in names:
        if name in case:
            continue
        best, best_gain = None, -1
        for value in factors[name]:
            trial = case | {name: value}
            if not _completable(trial, factors, names, allowed):
                continue
            gain = sum(
                1
                for other, chosen in case.items()
                if ((other, chosen), (name, value)) in uncovered
                or ((name, value), (other, chosen)) in uncovered
            )
            if gain > best_gain:
                best, best_gain = value, gain
        if best_gain < 0:
            return None
        case[name] = best
    ordered = {name: case[name] for name in names}
    return ordered if allowed(ordered) else None


def _completable(
    partial: Case, factors: dict[str, list[Any]], names: list[str], allowed: Callable[[Case], bool]
) -> bool:
    """Whether some allowed case extends ``partial`` (the first one found, depth first)."""
    rest = [n for n in names if n not in partial]
    case = {name: partial.get(name) for name in names}  # one dict, refilled for each candidate
    for values in itertools.product(*(factors[n] for n in rest)):
        case.update(zip(rest, values, strict=True))
        if allowed(case):
            return True
    return False
