"""Runnable demos of the pillars, one module per pillar, for the notebooks and the tests.

They sit above the pillars (``fusion``, ``precision``, ``consistency``) and use their public API, the
embedded ``models`` and the training loop; nothing in a pillar imports them. Multi-process demos keep
their worker functions at module level here, because the spawn start method imports them by name.
"""
