"""pytest plugin of the Lockstep parity kit (entry point ``pytest11: lockstep``)."""
