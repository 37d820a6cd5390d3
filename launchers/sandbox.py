"""mgrpo-sandbox: run one Python program from standard input in the sandbox and print one JSON line.

    echo 'print(6 * 7)' | mgrpo-sandbox [--wall-time-s 5] [--memory-mb 512] [--isolation bwrap] [--stdin FILE]

The line holds outcome (ok | error | timeout | limit), limit (which one, or null), exit_status, stdout,
stderr, whether each was truncated, wall_s and the isolation in force; the start-up line on stderr names the
isolation and the limits. The flags default to the run config's `sandbox:` section. Exit status 0 when the
program ran (whatever its outcome), 2 when the flags or the machine refuse (e.g. --isolation bwrap without
bubblewrap), 1 when the sandbox itself failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mgrpo.config.choices import Isolation, values
from mgrpo.config.schema import SandboxConfig
from mgrpo.config.validate import InputError, raise_errors, sandbox_errors

# pool_size: one call needs no pre-started sandbox; uid and concurrency are a run's concerns
_NOT_FLAGS = {"pool_size", "max_concurrency", "uid"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mgrpo-sandbox", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    defaults = SandboxConfig()
    for f in dataclasses.fields(SandboxConfig):
        if f.name in _NOT_FLAGS:
            continue
        default = getattr(defaults, f.name)
        kind = {int: int, float: float}.get(type(default), str)
        extra = {"choices": values(Isolation)} if f.name == "isolation" else {}
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=str(default) if extra else default,
                       help=f"(default {default!s}; config sandbox.{f.name})", **extra)
    p.add_argument("--stdin", metavar="FILE", help="a file given to the program as its standard input")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cfg = SandboxConfig(pool_size=0, max_concurrency=1,
                        **{f.name: getattr(args, f.name) for f in dataclasses.fields(SandboxConfig)
                           if f.name not in _NOT_FLAGS})
    try:
        raise_errors(sandbox_errors(cfg))  # before anything is read or started
        stdin = ""
        if args.stdin:
            with open(args.stdin, encoding="utf-8") as f:
                stdin = f.read()
        code = sys.stdin.read()
        from mgrpo.sandbox import Sandbox, SandboxError

        with Sandbox(cfg) as sandbox:
            try:
                result = sandbox.run(code, stdin)
            except SandboxError as e:
                print(f"mgrpo-sandbox: {e}", file=sys.stderr)
                return 1
    except (InputError, OSError) as e:
        print(f"mgrpo-sandbox: {e}", file=sys.stderr)
        return 2
    print(result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
