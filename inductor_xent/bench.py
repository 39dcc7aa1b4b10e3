"""``python -m inductor_xent bench``: dispatches to the benchmark scripts in ``benchmarks/``.

The scripts live in the source tree (they import optional peers and plotting libraries), so this
command works from a checkout or an editable install.

    python -m inductor_xent bench kernels [--shapes ... --data ... --methods ... --out DIR]
    python -m inductor_xent bench e2e     [--out DIR]          # an HF training step, both backends
    python -m inductor_xent bench rl      [--shapes qwen2.5-7b --methods ... --out DIR]  # log-probs + entropy
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = {"kernels": "bench_kernels.py", "e2e": "bench_e2e.py", "rl": "bench_rl.py"}


def _load(name: str):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / SCRIPTS[name]
    if not path.exists():
        raise SystemExit(f"{path} not found: run `python -m inductor_xent bench` from a source checkout "
                         "(git clone ... && pip install -e '.[bench]')")
    spec = importlib.util.spec_from_file_location(f"inductor_xent_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    return module


def main(argv) -> int:
    argv = list(argv)
    which = "kernels"
    if argv and argv[0] in SCRIPTS:
        which = argv.pop(0)
    elif argv and not argv[0].startswith("-"):
        print(f"unknown benchmark {argv[0]!r}; choose one of {', '.join(SCRIPTS)}", file=sys.stderr)
        return 2
    result = _load(which).main(argv)
    return result if isinstance(result, int) else 0
