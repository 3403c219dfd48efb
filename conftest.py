"""Hypothesis profiles for the whole suite: ``ci`` by default, ``--hypothesis-profile=stress``
for long runs. Lives at the root so it loads before the Hypothesis plugin reads the option."""

from hypothesis import settings

from kvevict.testing import register_profiles

register_profiles()
settings.load_profile("ci")
