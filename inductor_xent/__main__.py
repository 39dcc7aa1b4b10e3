"""The command line: ``python -m inductor_xent demo`` (the main job) and ``python -m inductor_xent bench``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m inductor_xent {demo,bench} [options]

  demo    train a small causal LM with backend="inductor" and backend="inductor_xent" side by side
  bench   kernel and end-to-end benchmarks (GPU); see `python -m inductor_xent bench --help`
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo

        return demo(rest)
    if command == "bench":
        from .bench import main as bench

        return bench(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
