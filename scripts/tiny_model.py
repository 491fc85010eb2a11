#!/usr/bin/env python3
"""Thin wrapper: see sglang_disagg_ext/deploy/tiny_model.py (`--help`)."""
import os
import sys

# Runs from a checkout without installing the package too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_disagg_ext.deploy.tiny_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
