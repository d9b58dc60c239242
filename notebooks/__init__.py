"""Not code: this file makes pytest import notebooks/conftest.py as `notebooks.conftest`.

Without it, both conftest files would be imported under the bare name `conftest`, and tests that
do `from conftest import ...` could get this one.
"""
