"""gpt2attn's tests, one folder per subject (tests/model/, tests/formats/, ...), one file per unit.

The tests are a package so that the shared code imports by name from the checkout's root:
`from tests.helpers import tiny_config`, `from tests import fuzzing`; the fixtures every test
can take are in tests/conftest.py. pytest puts the root on sys.path (the first folder above
tests/ without an __init__.py); a script that needs the helpers runs as `python -m ...` from the root.
"""
