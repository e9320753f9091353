"""Two-skill arithmetic: the learning demo's task on which a team can matter.

"Read an integer n from standard input and print <expression>", where the expression uses one
skill or both. The ``add`` skill is the operators + and -, the ``mul`` skill * and //:

- single-skill problems: ``n <op> K`` for each operator and K = 1..99;
- within-skill two-operator problems (warm start only): ``n <op1> a <op2> b`` with both operators
  from one skill, so that each agent knows the two-operator program shape;
- compositions (train and held out): ``n <mul op> a <add op> b``, so they need both skills.

Statements name the operators in words ("n times 37 plus 5"), so an agent cannot solve a skill by
copying a symbol from the statement: it has to have learnt which program each word asks for.

Each agent's warm start is built on one skill (its single- and two-operator problems) plus a
glimpse of the other: ``OTHER_WARM`` single-operator problems per operator of the other skill
(shared by both warm starts, in no other part). So it starts able on its half, weak but not at
zero on the other half (something RL alone can raise), and unable on compositions (no warm start
holds an operator of each skill in one program). RL training and held-out problems mix both halves
and the compositions. Warm starts, their checks, training and held out are disjoint.
"""

from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Callable

from mars2.data.problem import Problem, TestCase, TestKind

# operator -> (its words in a statement, its name in problem ids, its function)
SKILLS: dict[str, dict[str, tuple[str, str, Callable[[int, int], int]]]] = {
    "add": {"+": ("plus", "plus", operator.add), "-": ("minus", "minus", operator.sub)},
    "mul": {
        "*": ("times", "times", operator.mul),
        "//": ("floor-divided by", "floordiv", operator.floordiv),
    },
}
GROUPS = ("add", "mul", "composition")
PARTS = (
    "warm_start_add",
    "warm_start_mul",
    "warm_check_add",
    "warm_check_mul",
    "train",
    "held_out",
    "validation",
)
# The study layout (``layout="study"``, `mars2.study`): the held-out part is replaced by a
# validation part (for any tuning) and a larger test part (never used to choose anything), so one
# evaluation of 144 test problems x 8 samples has a sampling SE of at most about 0.02.
STUDY_PARTS = (
    "warm_start_add",
    "warm_start_mul",
    "warm_check_add",
    "warm_check_mul",
    "train",
    "validation",
    "test",
)
LAYOUTS = ("suite", "study")
MAX_K = 99
# Per operator, how many of K = 1..MAX_K go to the warm start of the agent owning the operator,
# to the check that ends it, and to the held-out part; the rest are RL training problems.
WARM, CHECK, HELD_SINGLE = 30, 8, 12
WITHIN_WARM = 4  # warm-start two-operator problems per within-skill operator pair
# Per operator, how many of its warm-start problems also go to the other skill's warm start. At 0
# the other half stays at pass@1 0 for an agent alone whatever RL does (nothing to sample), and
# only 38% of the training problems carry any signal: neither agent learnt alone (README).
OTHER_WARM = 2
COMPOSITIONS_TRAIN, COMPOSITIONS_HELD = 16, 3  # per (mul, add) operator pair (4 pairs)
# Study layout, per operator: WARM + CHECK as above, then validation and test K; per (mul, add)
# operator pair: validation and test compositions (training keeps COMPOSITIONS_TRAIN).
STUDY_VALIDATION, STUDY_TEST = 6, 24
STUDY_COMPOSITIONS_VALIDATION, STUDY_COMPOSITIONS_TEST = 2, 12
INPUT_RANGE = (-100_000, 100_000)  # wide enough that n // a differs for a and a + 1


def skill_of(symbol: str) -> str:
    """The skill an operator belongs to."""
    for skill, ops in SKILLS.items():
        if symbol in ops:
            return skill
    raise ValueError(f"unknown operator {symbol!r}")


def _apply(symbol: str, left: int, right: int) -> int:
    return SKILLS[skill_of(symbol)][symbol][2](left, right)


def evaluate(n: int, terms: tuple[tuple[str, int], ...]) -> int:
    """Python's value of ``n <op1> k1 [<op2> k2]``: * and // bind tighter than + and -."""
    if len(terms) == 1:
        ((op, k),) = terms
        return _apply(op, n, k)
    (op1, a), (op2, b) = terms
    if skill_of(op1) == "add" and skill_of(op2) == "mul":
        return _apply(op1, n, _apply(op2, a, b))
    return _apply(op2, _apply(op1, n, a), b)


def _problem(terms: tuple[tuple[str, int], ...], group: str, seed: int,
             num_public: int, num_private: int) -> Problem:  # fmt: skip
    expression = " ".join(f"{op} {k}" for op, k in terms)
    words = " ".join(f"{SKILLS[skill_of(op)][op][0]} {k}" for op, k in terms)
    name = "_".join(f"{SKILLS[skill_of(op)][op][1]}{k}" for op, k in terms)
    rng = random.Random(f"{seed}-skills-{name}")
    inputs = [rng.randint(*INPUT_RANGE) for _ in range(num_public + num_private)]
    cases = [TestCase(str(n), str(evaluate(n, terms))) for n in inputs]
    return Problem(
        id=f"skills/{name}",
        statement=f"Read an integer n from standard input and print n {words}.",
        test_kind=TestKind.STDIN,
        public_tests=tuple(cases[:num_public]),
        private_tests=tuple(cases[num_public:]),
        metadata={
            "source": "skills",
            "difficulty": group,  # the eval breakdown groups by difficulty
            "group": group,
            "skills": sorted({skill_of(op) for op, _ in terms}),
            "reference_solution": f"print(int(input()) {expression})\n",
        },
    )


def skill_parts(
    seed: int = 0, num_public: int = 2, num_private: int = 3, layout: str = "suite"
) -> dict[str, list[Problem]]:
    """The disjoint parts: each skill's warm start and check, RL training and held out (seeded).

    ``layout="study"`` replaces held out by ``validation`` and a larger ``test`` (`STUDY_PARTS`);
    warm starts and checks are the same problems in both layouts for one seed.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown skills layout {layout!r}: use one of {LAYOUTS}")
    study = layout == "study"
    rng = random.Random(f"{seed}-skills-split")
    parts: dict[str, list[Problem]] = {part: [] for part in (STUDY_PARTS if study else PARTS)}
    drawn: set[tuple[tuple[str, int], ...]] = set()

    def add(part: str, terms: tuple[tuple[str, int], ...], group: str) -> None:
        drawn.add(terms)
        parts[part].append(_problem(terms, group, seed, num_public, num_private))

    def fresh_pair(op1: str, op2: str) -> tuple[tuple[str, int], ...]:
        while True:  # a two-operator problem never repeats, so parts stay disjoint
            terms = ((op1, rng.randint(1, MAX_K)), (op2, rng.randint(1, MAX_K)))
            if terms not in drawn:
                return terms

    for skill, ops in SKILLS.items():
        for symbol in ops:
            ks = rng.sample(range(1, MAX_K + 1), MAX_K)
            names: tuple[str, ...]
            sizes: tuple[int, ...]
            if study:
                names = (f"warm_start_{skill}", f"warm_check_{skill}", "validation", "test",
                         "train")  # fmt: skip
                sizes = (WARM, CHECK, STUDY_VALIDATION, STUDY_TEST)
            else:
                names = (f"warm_start_{skill}", f"warm_check_{skill}", "held_out", "train")
                sizes = (WARM, CHECK, HELD_SINGLE)
            cuts = (0, *itertools.accumulate(sizes), MAX_K)
            for part, (lo, hi) in zip(names, itertools.pairwise(cuts), strict=True):
                for k in ks[lo:hi]:
                    add(part, ((symbol, k),), skill)
            other = next(name for name in SKILLS if name != skill)
            for k in ks[:OTHER_WARM]:  # already in this skill's warm start, in no other part
                parts[f"warm_start_{other}"].append(
                    _problem(((symbol, k),), skill, seed, num_public, num_private)
                )
        for op1, op2 in itertools.product(ops, repeat=2):
            for _ in range(WITHIN_WARM):
                add(f"warm_start_{skill}", fresh_pair(op1, op2), skill)
    add_ops, mul_ops = list(SKILLS["add"]), list(SKILLS["mul"])
    for op1, op2 in itertools.product(mul_ops, add_ops):  # mul first: one reading only
        if study:
            layout_parts = ["validation"] * STUDY_COMPOSITIONS_VALIDATION + ["test"] * (
                STUDY_COMPOSITIONS_TEST
            )
        else:
            layout_parts = ["held_out"] * COMPOSITIONS_HELD
        layout_parts += ["train"] * COMPOSITIONS_TRAIN
        for part in layout_parts:
            add(part, fresh_pair(op1, op2), "composition")
    return parts
