"""The ``zero-plugin`` command (``cli``) and what ``zero-plugin launch`` prints before it starts the processes
(``estimate``).  ``python -m zero_plugin.run`` is ``zero_plugin/run.py``.
"""
