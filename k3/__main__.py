"""``python -m k3 …`` — the same as the ``k3`` console script."""

from k3.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
