"""What the plugin's hooks use and nothing else does: kv marker parsing (markers) and the
interrupt handling that records why a run stopped (interrupts). No torch at import."""
