"""Shim so that ``python cli.py ...`` works from a checkout; the real CLI is ``fsdptrain.cli:app``."""

from fsdptrain.cli import app

if __name__ == "__main__":
    app()
