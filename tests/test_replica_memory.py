"""The replica's resident-memory hygiene (replica/memory.py) on this machine's real kernel and libc."""
import subprocess
import sys
import textwrap

import pytest

from tests.servers import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and madvise")


STATUS_KB = """
def status_kb(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))
"""


def _run(code: str) -> list[str]:
    """Run `code` in a fresh interpreter (status_kb(field) defined); its printed words."""
    out = subprocess.run([sys.executable, "-c", STATUS_KB + textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_start_up_file_pages_are_released_and_torch_still_works(tmp_path):
    """A ready replica gives back the file-backed pages it touched while starting (libtorch's:
    ~130 MB). Shown on a file only the child maps (pages another process maps too, such as this
    test process's libtorch, are shared and stay), then torch still computes after the call."""
    data = tmp_path / "weights.bin"
    data.write_bytes(bytes(range(256)) * (256 << 10))  # 64 MiB
    before, after, result = _run(f"""
        import mmap
        from replica.memory import page_out_file_mappings
        with open({str(data)!r}, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert sum(mapped[i + 1] for i in range(0, len(mapped), 4096)) > 0  # fault every page in
        before = status_kb("RssFile")
        page_out_file_mappings()
        after = status_kb("RssFile")
        import torch
        page_out_file_mappings()
        x = torch.arange(12.0).reshape(3, 4)
        print(before, after, float((x @ x.T).sum()))
    """)
    assert int(before) - int(after) > 60 << 10, (before, after)  # kB: the 64 MiB mapping is gone
    assert float(result) == 1134.0  # torch's pages paged out fault back in: it still computes


def test_large_freed_tensors_leave_the_heap():
    """With the bounded mmap threshold a freed step-sized tensor returns to the OS at once."""
    grown, kept = _run("""
        from replica.memory import bound_heap_retention
        assert bound_heap_retention()
        import torch
        base = status_kb("RssAnon")
        for _ in range(3):  # glibc would raise its threshold after the first free and reuse the heap
            logits = torch.ones(64, 49152)  # one 64-sequence step's logits, 12.6 MB
            grown = status_kb("RssAnon") - base
            del logits
        print(grown, status_kb("RssAnon") - base)
    """)
    assert int(grown) > 10_000 and int(kept) < 2_000, (grown, kept)  # kB
