"""Reports from each process what ``zero-plugin launch --allocator`` preloaded: the variable and whether the
library named by ``PROBE_LIBRARY`` is mapped into the process (``test_accelerate.py``)."""

import os

from accelerate import Accelerator

accelerator = Accelerator()
with open("/proc/self/maps", encoding="utf-8") as f:
    mapped = {line.split()[-1] for line in f if len(line.split()) > 5}
line = (
    f"probe {accelerator.process_index}/{accelerator.num_processes} "
    f"mapped={os.environ['PROBE_LIBRARY'] in mapped} LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}\n"
)
os.write(1, line.encode())  # one write: the ranks share the pipe, and print() writes the newline apart
