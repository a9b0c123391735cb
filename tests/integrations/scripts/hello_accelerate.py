"""Smallest Accelerate script: reports how many processes Accelerate set up (launch-trap tests)."""

from accelerate import Accelerator

accelerator = Accelerator()
print(
    f"hello from {accelerator.process_index}/{accelerator.num_processes} {accelerator.distributed_type} "
    f"{type(accelerator).__module__}",
    flush=True,
)
