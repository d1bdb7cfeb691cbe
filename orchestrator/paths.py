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


def scope_of(path: str) -> str:
    """The branch a leaf path runs in (its innermost `.../branch:K`), "" for the program's
    own cursor."""
    found = _SCOPE.match(path)
    return found[1] if found else ""


def parent_of(scope: str) -> tuple[str, int] | None:
    """The bag path and member index of a branch scope (`2/branch:1` -> ("2", 1)); None
    when it names none."""
    found = _PARENT.match(scope)
    return (found[1], int(found[2])) if found else None
