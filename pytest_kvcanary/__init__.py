"""pytest-kvcanary: a pytest plugin that catches KV-cache corruption (the plugin: plugin.py).

PYTEST_DONT_REWRITE: the package may be imported before pytest loads it as a plugin (a pytester
test's outer run), when it can no longer be rewritten; its asserts are invariants that need no rewritten messages.
"""
