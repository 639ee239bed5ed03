"""Suite-wide settings.

Hypothesis's per-example deadline measures wall time, which on a shared 2-core machine
says more about the neighbours than about the code: properties are checked, speed is not.
"""

from hypothesis import settings

settings.register_profile("servegate", deadline=None)
settings.load_profile("servegate")
