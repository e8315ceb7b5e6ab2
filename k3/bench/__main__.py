"""``python -m k3.bench <name> [args]``: import ``k3.bench.<name>`` and call its ``main(args)``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import k3.bench


def _available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(k3.bench.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m k3.bench <name> [args]   names: {', '.join(_available())}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if not name.isidentifier() or name not in _available():
        print(f"unknown benchmark {name!r}; available: {', '.join(_available())}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"k3.bench.{name}")
    rc = mod.main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
