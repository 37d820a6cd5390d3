"""Whether a sandbox level works on this machine: a test that needs one skips without it (bubblewrap is a system
package: apt-get install bubblewrap), except where MGRPO_REQUIRE_SANDBOX=1 (.ci/run) makes a missing bwrap a
failure."""

from __future__ import annotations

import os

import pytest

REQUIRE = "MGRPO_REQUIRE_SANDBOX"


def require_level(level: str) -> None:
    """Skip (or fail, for bwrap under MGRPO_REQUIRE_SANDBOX=1) unless `level` works here."""
    from mgrpo.sandbox.probe import probe

    problem = probe()[level]
    if problem and level == "bwrap" and os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but the sandbox cannot run: {problem}")
    if problem:
        pytest.skip(f"sandbox level {level} unavailable here: {problem}")


def require_any_level() -> None:
    """What sandbox.isolation=auto needs: bwrap, or else unshare."""
    from mgrpo.sandbox.probe import probe

    problems = probe()
    if problems["bwrap"] and not problems["unshare"]:
        return
    require_level("bwrap")
