"""The benchmark suites, one module each (``forms``, ``recurrences``, ``decode``,
``comm``, ``train_step``), over shared timing (``timing``); ``cli`` is the command
line of ``python -m experiments.benchmark``.
"""
