"""Builds the chat messages for fresh solutions and for refinements of an existing node."""

from __future__ import annotations

from dataclasses import dataclass

from mars2.data.problem import Problem, TestKind
from mars2.generation.base import Messages
from mars2.generation.prompt import CUTTABLE
from mars2.sandbox.base import Verdict
from mars2.search.tree import Node

DEFAULT_SYSTEM = (
    "You are an expert Python programmer. Think briefly, then answer with one ```python code block."
)
DEFAULT_FRESH = "{statement}\n{starter}\n{instructions}"
DEFAULT_REFINE = (
    "{statement}\n{starter}\n{instructions}\n\n"
    "A previous attempt:\n```python\n{code}\n```\n{feedback}\n"
    "Fix it and give the corrected, complete solution."
)
# A parent without code: its completion (often truncated reasoning) is not shown, the problem is.
DEFAULT_REFINE_NO_CODE = (
    "{statement}\n{starter}\n{instructions}\n\n"
    "A previous attempt contained no code (no ```python code block that parses; it may have run "
    "out of length before writing one). Give a complete solution in one ```python code block."
)
INSTRUCTIONS = {
    TestKind.STDIN: "Read the input from standard input and print the answer to standard output.",
    TestKind.CALL: "Write the function `{fn_name}` (a top-level function or a method of `class Solution`); it must return the answer.",
    TestKind.HUMANEVAL: "Complete the function `{fn_name}` and give the whole function.",
}


@dataclass(frozen=True)
class PromptBuilder:
    """Prompt templates (from config); fields: statement, starter, instructions, code, feedback.

    `refine_no_code` is the refinement prompt for a parent whose answer had no code (fields:
    statement, starter, instructions). A parent's code longer than `max_code_chars` keeps its
    head; with the agent's `generation.max_prompt_tokens` set, the code is what gets cut (see
    `mars2.generation.prompt.encode_prompt`), never the statement or the instructions.
    """

    system: str = DEFAULT_SYSTEM
    fresh: str = DEFAULT_FRESH
    refine: str = DEFAULT_REFINE
    refine_no_code: str = DEFAULT_REFINE_NO_CODE
    max_failures_shown: int = 3
    max_code_chars: int = 12000

    def __post_init__(self) -> None:
        if self.max_code_chars < 1 or self.max_failures_shown < 0:
            raise ValueError("max_code_chars must be >= 1 and max_failures_shown >= 0")

    def _fields(self, problem: Problem) -> dict[str, str]:
        starter = (
            f"\nStarter code:\n```python\n{problem.starter_code}\n```\n"
            if problem.starter_code
            else ""
        )
        return {
            "statement": problem.statement.strip(),
            "starter": starter,
            "instructions": INSTRUCTIONS[problem.test_kind].format(fn_name=problem.fn_name),
        }

    def _chat(self, user: str) -> Messages:
        chat = [{"role": "system", "content": self.system}] if self.system else []
        return [*chat, {"role": "user", "content": user}]

    def fresh_messages(self, problem: Problem) -> Messages:
        """Ask for a new solution."""
        return self._chat(self.fresh.format(**self._fields(problem)))

    def uncut_messages(self, problem: Problem) -> list[Messages]:
        """The problem's prompts that `max_prompt_tokens` can never shorten (they hold no code):
        the fresh one, and the refinement of an answer that had no code."""
        return [
            self.fresh_messages(problem),
            self._chat(self.refine_no_code.format(**self._fields(problem))),
        ]

    def feedback_text(self, node: Node) -> str:
        """What went wrong with `node`, from its public tests only.

        Nothing here depends on tests the policy cannot see: an answer that passed every public
        test gets the same words whether or not it failed a private one.
        """
        if node.code is None:
            return "It contained no ```python code block that parses."
        failures = [f for f in node.grade.public if f.verdict is not Verdict.PASSED]
        if not failures:
            return (
                "It passed every example test shown. Check it again for edge cases and "
                "efficiency, and improve it if needed."
            )
        parts = []
        for item in failures[: self.max_failures_shown]:
            text = f"Input:\n{item.input}\nExpected:\n{item.expected}\n"
            if item.error:
                text += f"Error ({item.verdict.value}):\n{item.error}\n"
            else:
                text += f"Got ({item.verdict.value}):\n{item.actual}\n"
            parts.append(text)
        more = len(failures) - self.max_failures_shown
        tail = f"\n(and {more} more failing tests)" if more > 0 else ""
        return "It failed these tests:\n" + "\n".join(parts) + tail

    def refine_messages(self, problem: Problem, parent: Node) -> Messages:
        """Ask for a corrected solution given `parent`'s code and its execution feedback."""
        fields = self._fields(problem)
        if parent.code is None:
            return self._chat(self.refine_no_code.format(**fields))
        code = parent.code.strip()
        if len(code) > self.max_code_chars:
            cut = len(code) - self.max_code_chars
            code = f"{code[: self.max_code_chars]}\n# ... ({cut} more characters cut)"
        fields.update(code=code, feedback=self.feedback_text(parent))
        chat = self._chat(self.refine.format(**fields))
        chat[-1][CUTTABLE] = code
        return chat

    def messages_for(self, problem: Problem, parent: Node) -> Messages:
        """Fresh prompt under the root, refinement prompt under any other node."""
        return (
            self.fresh_messages(problem)
            if parent.is_root
            else self.refine_messages(problem, parent)
        )
