"""An unmodified Lightning script: no zero_plugin import. Under ``python -m zero_plugin.run`` with
``PL_TRAINER_STRATEGY=zero3`` its Trainer must pick zero_plugin's strategy."""

import lightning as L

trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_epochs=1)
print("STRATEGY", type(trainer.strategy).__name__, trainer.strategy.config.stage)
