"""Shared helpers for the test suite (importable as ``dspine_testing`` via pytest pythonpath)."""
