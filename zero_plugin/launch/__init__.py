"""The ``zero-plugin`` command (``cli``): ``launch`` (``launcher``, the parent that starts the ranks, and what it
prints before it starts them, ``estimate``), ``estimate`` and ``consolidate``.  The child every rank runs,
``python -m zero_plugin.run``, is ``zero_plugin/run.py``.
"""
