"""The one compiled piece: routing/_prefix_match.c (the prefix table's lookup, insert and remove). Optional: where
no C compiler is found the install still succeeds and routing uses its Python path."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("routing._prefix_match", ["routing/_prefix_match.c"], optional=True,
                             extra_compile_args=["-O2"])])
