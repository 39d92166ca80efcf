"""The replica's resident-memory hygiene (replica/memory.py) on this machine's real kernel and libc."""
import subprocess
import sys
import textwrap

import pytest

from tests.servers import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and madvise")


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_start_up_library_pages_are_released_and_torch_still_works():
    """Importing torch faults in ~130 MB of libtorch; a ready replica gives them back (a fresh
    process: pages mapped by another process, such as this test's, could not be dropped)."""
    before, after, advised, result = _run("""
        from replica.memory import page_out_file_mappings
        import torch
        def rss_file():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssFile:"))
        before = rss_file()
        advised = page_out_file_mappings()
        after = rss_file()
        x = torch.arange(12.0).reshape(3, 4)
        print(before, after, advised, float((x @ x.T).sum()))
    """)
    assert int(advised) > 100 << 20
    assert int(after) < int(before) / 2, (before, after)
    assert float(result) == 1134.0  # code paged out faults back in: torch still computes


def test_large_freed_tensors_leave_the_heap():
    """With the bounded mmap threshold a freed step-sized tensor returns to the OS at once."""
    grown, kept = _run("""
        from replica.memory import bound_heap_retention
        assert bound_heap_retention()
        import torch
        def rss_anon():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:"))
        base = rss_anon()
        for _ in range(3):  # glibc would raise its threshold after the first free and reuse the heap
            logits = torch.ones(64, 49152)  # one 64-sequence step's logits, 12.6 MB
            grown = rss_anon() - base
            del logits
        print(grown, rss_anon() - base)
    """)
    assert int(grown) > 10_000 and int(kept) < 2_000, (grown, kept)  # kB
