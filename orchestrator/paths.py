"""Step paths of parallel branches: which cursor a leaf's path answers to.

A leaf inside a bag's branch has a path such as `2/branch:1/0` (step 0 of the branch that is
member 1 of the bag at step 2). Its cursor is the branch's own (`<prefix>:{wf}:cur:<scope>`),
not the program's; lua/*.lua find the scope with the same pattern.
"""

from __future__ import annotations

import re

# DOTALL: Lua's `.` matches any byte, a newline too.
_SCOPE = re.compile(r"^(.*/branch:[0-9]+)/", re.DOTALL)
_PARENT = re.compile(r"^(.*)/branch:([0-9]+)$", re.DOTALL)


# A compensation's leaf (`saga:2` undoes top-level step 2) runs in the scope `saga`, whose
# cursor is `<prefix>:{wf}:cur:saga` (lua/*.lua match the same pattern).
SAGA = "saga"
_SAGA_LEAF = re.compile(r"^saga:[0-9]+$")


def is_saga(path: str) -> bool:
    """Whether a leaf path is a compensation's (`saga:<step>`)."""
    return _SAGA_LEAF.match(path) is not None


def saga_step(path: str) -> int:
    """The top-level step a compensation's leaf undoes (`saga:2` -> 2)."""
    if not is_saga(path):
        raise ValueError(f"{path!r}: not a compensation's leaf")
    return int(path.removeprefix(f"{SAGA}:"))


def scope_of(path: str) -> str:
    """The branch a leaf path runs in (its innermost `.../branch:K`), `saga` for a
    compensation, "" for the program's own cursor."""
    if is_saga(path):
        return SAGA
    found = _SCOPE.match(path)
    return found[1] if found else ""


def parent_of(scope: str) -> tuple[str, int] | None:
    """The bag path and member index of a branch scope (`2/branch:1` -> ("2", 1)); None
    when it names none."""
    found = _PARENT.match(scope)
    return (found[1], int(found[2])) if found else None


def live_status(path: str) -> str:
    """The status in which a report for the leaf at `path` counts: a compensation's while
    the program is compensating, any other while it runs."""
    return "compensating" if is_saga(path) else "running"
