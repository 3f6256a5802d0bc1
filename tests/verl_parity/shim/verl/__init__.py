"""A stand-in for verl's import surface, implemented by fsdptrain (tests/verl_parity/README.md).

Only names and calling conventions are translated here; every number comes from an fsdptrain function. This package
is put first on sys.path by scripts/run_verl_parity.py and is never imported by fsdptrain or its test suite.
"""
