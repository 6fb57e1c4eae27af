"""Opt-in pytest plugins that run other projects' own distributed test suites on dstest's worlds.

- :mod:`dstest.compat.deepspeed`: a DeepSpeed checkout's ``tests/unit`` (``pytest -p dstest.compat.deepspeed``).
- :mod:`dstest.compat.torch`: test files on torch's own distributed test bases (``pytest -p dstest.compat.torch``).
"""
