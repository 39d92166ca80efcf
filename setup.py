"""The compiled pieces: routing/_prefix_match.c (the prefix table's lookup, insert and remove),
routing/_block_hash.c (chained block hashes, with the vendored xxHash header),
routing/_decision.c (a decision's per-candidate loops: load estimate, cache_aware's choice),
gateway/_http_head.c (the hot path's plain request heads), protocol/_strip_ids.c (token IDs cut
out of relayed answers) and observability/_record_line.c (a request record's log line). Optional:
where no C compiler is found the install still succeeds and each uses its Python path."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("routing._prefix_match", ["routing/_prefix_match.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("routing._block_hash", ["routing/_block_hash.c"], optional=True,
                             depends=["routing/_vendor/xxhash.h"], extra_compile_args=["-O2"]),
                   Extension("routing._decision", ["routing/_decision.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("gateway._http_head", ["gateway/_http_head.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("protocol._strip_ids", ["protocol/_strip_ids.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("observability._record_line", ["observability/_record_line.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("tokenization._word_split", ["tokenization/_word_split.c"], optional=True,
                             extra_compile_args=["-O2"])])
