"""edgetrain.allocator: with freed memory kept, a step's second allocation of a large buffer
faults no pages in; with glibc's defaults every page of it faults in again."""

import ctypes
import subprocess
import sys

import pytest

try:
    ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    GLIBC = True
except AttributeError:
    GLIBC = False

SCRIPT = """
import resource, sys
from edgetrain.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
size = 64 << 20
buf = bytearray(size); del buf  # the first step touches its memory
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buf = bytearray(size); del buf  # the next step allocates the same again
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True).stdout
    kept, faults = out.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_is_reused_without_page_faults():
    kept, faults = page_faults("keep")
    assert kept
    assert faults < 1024  # 64 MiB is 16384 pages of 4 KiB


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_glibc_default_faults_every_page_in_again():
    kept, faults = page_faults("default")
    assert not kept
    assert faults > 8192
