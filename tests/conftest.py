"""Shared pytest setup: make `tests/` importable so test modules share helpers."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
